"""`rlserve serve` with a deployment: replicas + vllm-router on server.port + the admin address, until
SIGINT/SIGTERM, which stop every child before the supervisor exits."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal

import uvicorn

from rlserve.config.load import configure_logging
from rlserve.config.schema import Config
from rlserve.deploy.supervisor import Deployment, Replica, new_key, private_dir

log = logging.getLogger("rlserve.deploy")


def serve_deployment(config: Config) -> None:
    check_router_exposure(config)
    configure_logging(config)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per fan-out call is noise
    try:
        asyncio.run(_main(config))
    except RuntimeError as exc:
        raise SystemExit(f"rlserve: error: {exc}") from None


def check_router_exposure(config: Config) -> None:
    """vllm-router serves worker routes on its public port and checks no key on them: off loopback, anyone
    who reaches that port could add a server of theirs and be sent the users' requests. Opening it takes
    an explicit opt-in, as admin routes without a key do."""
    from rlserve.server.listen import is_loopback

    host = config.server.host
    if is_loopback(host) or config.deployment.router.allow_open_worker_routes:
        return
    raise SystemExit(
        f"rlserve: error: server.host {host!r} is reachable from other machines, and the deployment's vllm-router "
        "answers its worker routes (/add_worker, /remove_worker, /workers) there without a key: anyone who reaches "
        "the port could add a server of theirs and be sent your requests. Bind --server.host 127.0.0.1, or, with "
        "the port behind a firewall that admits only your clients, pass --deployment.router.allow_open_worker_routes true"
    )


class _AdminServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the supervisor owns SIGINT/SIGTERM: it must stop its children first
        yield


async def _main(config: Config) -> None:
    from rlserve.deploy.admin import build_admin_app
    from rlserve.server.listen import bind

    stop = asyncio.Event()
    host, port = config.server.host, config.server.port
    admin_port = config.deployment.admin_port if config.deployment.admin_port is not None else (port + 1 if port else 0)
    admin_host = _admin_host(config)
    sock = bind(admin_host, admin_port)
    admin_url = f"http://{admin_host}:{sock.getsockname()[1]}"
    key, workdir, dep = new_key(), None, None
    try:  # whatever fails from here on (a replica that cannot even be set up included) closes and removes these
        workdir = private_dir("rlserve-deploy-")
        if config.deployment.snapshot_dir is None:
            config.deployment.snapshot_dir = str(workdir / "snapshots")
        dep = Deployment(config, _replicas(config, key, admin_url, workdir), key, host, port)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, whose own SIGTERM handler exits mid-loop
            loop.add_signal_handler(sig, stop.set)
        starting = asyncio.ensure_future(dep.start())
        await asyncio.wait([starting, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            return
        starting.result()
        server = _AdminServer(uvicorn.Config(build_admin_app(dep), log_level=config.server.log_level))
        serving = asyncio.ensure_future(server.serve(sockets=[sock]))
        watching = asyncio.ensure_future(dep.watch())
        assert dep.router is not None
        d = config.deployment
        where = " on Ray nodes" if d.on_ray else ""
        shape = (
            f"{d.prefill_servers} prefill + {d.decode_servers} decode replicas{where} behind vllm-router in P/D mode"
            if d.type == "disaggregated"
            else f"{d.copy_size} replicas behind vllm-router"
        )
        if d.copies > 1:
            others = ", ".join(r.url for r in dep.routers[1:])
            shape = f"{d.copies} copies of {shape}; the other copies on {others}"
        print(
            f"rlserve: serving {config.model.served_model_name or config.model.name or 'rlserve-default'} on "
            f"{dep.router.url} ({shape}; admin: {admin_url})",
            flush=True,
        )
        await asyncio.wait([serving, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        watching.cancel()
        server.should_exit = True
        await asyncio.gather(serving, watching, return_exceptions=True)
    finally:
        if dep is not None:
            await dep.stop()
            if config.deployment.on_ray:
                from rlserve.deploy.ray_nodes import release

                release([s.replica for s in dep.slots])
        sock.close()
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
        log.info("deployment stopped")


def _admin_host(config: Config) -> str:
    """The admin address opens to the network only behind a key: weights and pauses are not public."""
    host = config.server.host
    if host in ("127.0.0.1", "localhost", "::1") or config.server.admin_api_key or config.server.api_key:
        return host
    log.warning(
        "server.host is %s but no server.admin_api_key is set: the admin address listens on 127.0.0.1 "
        "only (set server.admin_api_key to open it)",
        host,
    )
    return "127.0.0.1"


def _replicas(config: Config, key: str, admin_url: str, workdir) -> list[Replica]:
    d = config.deployment
    if d.on_ray:
        from rlserve.deploy.ray_nodes import ray_replicas

        return ray_replicas(config, key, admin_url)
    from rlserve.deploy.replica import LocalReplica, replica_cores, usable_cores

    gpu = config.model.device in ("auto", "cuda") and _has_cuda()
    cores = replica_cores(config)
    if d.bind_cores and cores[0] is None:
        log.info(
            "not binding replicas to cores: their threads do not fit the %d usable cores, or this OS cannot bind",
            len(usable_cores()),
        )
    return [LocalReplica(i, config, workdir, key, admin_url, gpu=gpu, cores=c) for i, c in enumerate(cores)]


def _has_cuda() -> bool:
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return False
    import torch

    return torch.cuda.is_available()
