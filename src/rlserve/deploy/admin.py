"""The deployment's admin address: every admin call reaches every serving replica and answers once all
have applied it; `GET /deployment` lists the replicas."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from rlserve.deploy import snapshot
from rlserve.deploy.replica import engines_per_replica
from rlserve.deploy.supervisor import Deployment, Slot
from rlserve.deploy.transaction import PutBack, refused_unchanged, restore, undo_for
from rlserve.server.auth import ADMIN_PATHS, Gate
from rlserve.server.errors import APIError, install_error_handlers

_FORWARDED_HEADERS = ("authorization", "content-type")


def build_admin_app(dep: Deployment) -> FastAPI:
    app = FastAPI(title="rlserve deployment admin", redirect_slashes=False)
    install_error_handlers(app)

    @app.get("/deployment")
    async def deployment() -> dict:
        return await dep.describe()

    @app.get("/health")
    async def health() -> JSONResponse:
        up = bool(dep.routers) and all(r.exited() is None for r in dep.routers) and bool(dep.serving())
        return JSONResponse(
            {"status": "healthy" if up else "unhealthy", "replicas_serving": len(dep.serving())},
            status_code=200 if up else 503,
        )

    @app.get("/get_world_size")
    async def world_size() -> dict:
        """How many ranks this address stands for in a trainer's broadcast group."""
        return {"world_size": len(dep.serving()) * ranks_per_replica(dep)}

    @app.get("/get_weight_version")
    @app.get("/weight_info")
    async def weight_version() -> dict:
        return {"weight_version": dep.state.weight_version, "policy_version": dep.state.policy_version}

    @app.get("/is_paused")
    async def is_paused() -> dict:
        return {"is_paused": dep.state.paused is not None}

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def fan_out(path: str, request: Request) -> Response:
        path = "/" + path.strip("/")
        if path not in ADMIN_PATHS:
            public = dep.router.url if dep.router else "the deployment's public URL"
            raise APIError(404, f"{path} is not an admin route; send generation and other calls to {public}")
        return await _fan_out(dep, path, request)

    app.add_middleware(Gate, api_key=dep.config.server.api_key, admin_api_key=dep.config.server.admin_api_key)
    return app


async def _fan_out(dep: Deployment, path: str, request: Request) -> Response:
    raw = await request.body()
    body = _json(raw, request)
    headers = {k: v for k in _FORWARDED_HEADERS if (v := request.headers.get(k)) is not None} | dep.headers
    async with dep.lock:
        targets = _targets(dep, path, body)
        if not targets and snapshot.is_push(path, body) and dep.serving():
            raise APIError(
                409,
                "no serving replica is in the trainer's group: call /init_broadcaster (or, for vLLM's weight transfer, "
                "/init_weight_transfer_engine) first",
            )
        if not targets:
            raise APIError(503, "no replica is serving; GET /deployment shows why")
        contents = _bodies(dep, path, body, raw, targets)
        results = await asyncio.gather(
            *(
                dep.http.request(
                    request.method, f"{slot.url}{path}", params=request.query_params, content=content, headers=headers
                )
                for slot, content in zip(targets, contents)
            ),
            return_exceptions=True,
        )
        return await _settle(dep, path, body, request, targets, results)


def _json(raw: bytes, request: Request) -> dict[str, Any]:
    if not raw or "json" not in request.headers.get("content-type", "application/json"):
        return {}
    try:
        body = json.loads(raw)
    except ValueError:
        return {}  # the replicas answer the parse error themselves
    return body if isinstance(body, dict) else {}


def ranks_per_replica(dep: Deployment) -> int:
    """Members each replica brings to a trainer's group: one per data-parallel engine, as a lone server's
    /get_world_size says (an engine's tensor-parallel workers get their slices from it, not from the group;
    prefill and decode replicas run the same engines)."""
    return engines_per_replica(dep.config)


def _targets(dep: Deployment, path: str, body: dict[str, Any]) -> list[Slot]:
    if snapshot.is_push(path, body):  # only replicas in the trainer's group can receive its broadcast
        return [s for s in dep.serving() if (s.replica.index, s.incarnation) in dep.group]
    return dep.serving()


def _bodies(dep: Deployment, path: str, body: dict[str, Any], raw: bytes, targets: list[Slot]) -> list[bytes]:
    if path == "/init_weight_transfer_engine":
        return _transfer_bodies(body, raw, targets, ranks_per_replica(dep))
    if path != "/init_broadcaster":
        return [raw] * len(targets)
    # one group: the trainer (rank 0) and every replica's engines, each replica from its own first rank
    each = ranks_per_replica(dep)
    offset, world = int(body.get("rank_offset", 0)), body.get("inference_world_size")
    if world is not None and int(world) < offset + len(targets) * each:
        raise APIError(
            400,
            f"this deployment's {len(targets)} serving replicas join with {len(targets) * each} ranks: set "
            f"inference_world_size to at least rank_offset + {len(targets) * each} (GET /get_world_size tells "
            "the count)",
            param="inference_world_size",
        )
    world = int(world) if world is not None else offset + len(targets) * each
    return [
        json.dumps(body | {"rank_offset": offset + i * each, "inference_world_size": world}).encode()
        for i in range(len(targets))
    ]


def _transfer_bodies(body: dict[str, Any], raw: bytes, targets: list[Slot], each: int) -> list[bytes]:
    """vLLM's form of the same: init_info's rank_offset is the first replica's first rank, the others follow."""
    info = body.get("init_info")
    if not isinstance(info, dict) or "rank_offset" not in info or "world_size" not in info:
        return [raw] * len(targets)  # the replicas name what is missing
    try:
        offset, world = int(info["rank_offset"]), int(info["world_size"])
    except (TypeError, ValueError):
        return [raw] * len(targets)
    if world < offset + len(targets) * each:
        raise APIError(
            400,
            f"this deployment's {len(targets)} serving replicas join with {len(targets) * each} ranks: set "
            f"init_info.world_size to at least rank_offset + {len(targets) * each} (GET /get_world_size tells "
            "the count)",
            param="init_info",
        )
    return [
        json.dumps(body | {"init_info": info | {"rank_offset": offset + i * each}}).encode()
        for i in range(len(targets))
    ]


async def _settle(
    dep: Deployment, path: str, body: dict[str, Any], request: Request, targets: list[Slot], results: list
) -> Response:
    ok = [(s, r) for s, r in zip(targets, results) if isinstance(r, httpx.Response) and r.status_code < 400]
    failed = [(s, r) for s, r in zip(targets, results) if (s, r) not in ok]
    if not ok:  # nobody changed: pass the (first) refusal through as it is
        slot, r = failed[0]
        if isinstance(r, httpx.Response):
            return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))
        raise APIError(502, f"{path} reached no replica: " + "; ".join(_why(s, r) for s, r in failed))
    if failed and (put_back := undo_for(path, body)) is not None:
        return await _all_or_none(dep, path, [s for s, _ in ok], failed, put_back)
    _record(dep, path, body, request, [s for s, _ in ok])
    for slot, r in failed:
        await dep.evict(slot, f"{path} failed there: {_why(slot, r)}")
    before, pushed = dep.state.policy_version, snapshot.is_push(path, body)
    await _check_versions(dep, [s for s, _ in ok] if pushed else None)
    if pushed and dep.state.policy_version != before:  # a push committed
        await snapshot.set_aside(dep, [s for s in dep.serving() if s not in targets])
        await snapshot.keep_copy(dep, [s for s, _ in ok if s.status == "serving"])
    for slot in [s for s in dep.slots if s.status == "stale"]:
        await dep.rejoin(slot)
    if failed:
        names = ", ".join(f"{s.name} ({s.url})" for s, _ in failed)
        raise APIError(
            502,
            f"{path} failed on {names}: "
            + "; ".join(_why(s, r) for s, r in failed)
            + f". It left the router's rotation and rejoins after a restart at the current weights; "
            f"the other replicas applied it and serve policy_version {dep.state.policy_version}",
        )
    first = ok[0][1]
    return Response(first.content, status_code=first.status_code, media_type=first.headers.get("content-type"))


async def _all_or_none(
    dep: Deployment, path: str, applied: list[Slot], failed: list[tuple[Slot, Any]], put_back: PutBack
) -> Response:
    """Some replicas applied an update, others did not: undo it where it was applied, so all keep the
    previous weights (or adapter) and versions, and name the replicas that failed."""
    before = (dep.state.policy_version, dep.state.weight_version)
    unrestored = await restore(dep, applied, put_back)
    for slot, r in failed:
        now = await _versions_or_error(dep, slot)
        if not refused_unchanged(r, before, now):  # killed, unreachable, or left in another state
            await dep.evict(slot, f"{path} failed there: {_why(slot, r)}")
    for slot in unrestored:
        await dep.evict(slot, slot.detail)
    names = ", ".join(f"{slot.name} ({slot.url})" for slot, _ in failed)
    refusals = [r.status_code for _, r in failed if isinstance(r, httpx.Response) and r.status_code < 500]
    raise APIError(
        refusals[0] if len(refusals) == len(failed) else 502,
        f"{path} failed on {names}: "
        + "; ".join(_why(slot, r) for slot, r in failed)
        + f". Nothing changed: every replica keeps (or was restored to) the previous weights, policy_version "
        f"{before[0]} ({before[1]!r}); fix the cause and send the update again",
    )


async def _versions_or_error(dep: Deployment, slot: Slot) -> tuple[int, str] | BaseException:
    try:
        return await dep._versions(slot)
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        return exc


def _why(slot: Slot, r: Any) -> str:
    if isinstance(r, httpx.Response):
        return f"{slot.name} answered {r.status_code}: {r.text[:300]}"
    return f"{slot.name} unreachable: {r!r}"


async def _check_versions(dep: Deployment, among: list[Slot] | None = None) -> None:
    """Every serving replica (of `among`) must now report the same versions; one that does not is taken out."""
    serving = [s for s in among if s.status == "serving"] if among is not None else dep.serving()
    versions = await asyncio.gather(*(dep._versions(s) for s in serving), return_exceptions=True)
    good = [v for v in versions if isinstance(v, tuple)]
    if not good:
        return
    expected = max(set(good), key=good.count)
    dep.state.policy_version, dep.state.weight_version = expected
    for slot, v in zip(serving, versions):
        if v != expected:
            await dep.evict(slot, f"reports {v}, the others {expected}")


def _record(dep: Deployment, path: str, body: dict[str, Any], request: Request, applied: list[Slot]) -> None:
    """Remember what a restarted replica must replay to serve what the others serve."""
    s, label = dep.state, body.get("weight_version")
    if path == "/update_weights" and "weight_path" in body:
        p = str(body["weight_path"])
        if (Path(p) / "adapter_config.json").exists():
            name = str(body.get("model_name") or Path(p).name)
            s.adapters[name] = ("/load_lora_adapter", {"lora_name": name, "lora_path": p})
        else:
            s.base, s.replayable = {"weight_dir": p, "weight_version": label}, None
    elif path == "/update_weights" and body.get("weight_dir") is not None:
        s.base, s.replayable = {"weight_dir": body["weight_dir"], "weight_version": label}, None
    elif path == "/update_weights_from_disk":
        s.base, s.replayable = {"weight_dir": body["model_path"], "weight_version": label}, None
    elif path in ("/load_lora_adapter", "/v1/load_lora_adapter"):
        name = str(body["lora_name"])
        s.adapters[name] = ("/load_lora_adapter", {"lora_name": name, "lora_path": body["lora_path"]})
    elif path == "/v1/unload_lora_adapter":
        s.adapters.pop(str(body.get("lora_name")), None)
    elif path == "/load_adapter":
        s.adapters["mlx-adapter"] = ("/load_adapter", {"adapter_path": body["adapter_path"]})
    elif path == "/upload_adapter":
        s.replayable = "an uploaded adapter cannot be replayed"
    elif snapshot.joins_group(path):
        dep.group = {(slot.replica.index, slot.incarnation) for slot in applied}
    elif path in ("/pause", "/pause_generation"):
        s.paused = "keep"  # a replica joining a paused deployment holds what it gets, like the others
    elif path in ("/resume", "/continue_generation"):
        s.paused = "keep" if request.query_params.get("steps") else None  # a step-limited resume freezes them again
