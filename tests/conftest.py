"""Shared fixtures: real `rlserve serve` processes on 127.0.0.1 with the embedded tiny model."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from forked_servers import ForkedServer, can_fork_with

# The suite checks the CPU engine against transformers' fp32 CPU forward, on any machine: a GPU machine's
# `auto` device would run bf16 on the GPU instead. The tests marked `cuda` ask for the GPU by name.
os.environ.setdefault("RLSERVE_DEVICE", "cpu")

# small and quick: the tiny model, a 64 MiB KV cache, a 512-token context
SERVER_DEFAULTS = ("--engine.kv_cache_bytes", str(64 << 20), "--model.max_model_len", "512")
_URL_LINE = re.compile(r"rlserve: serving \S+ on (http://\S+)")


def _one_default_tls_context() -> None:
    """httpx.get/post/stream build a client per call, and every client a TLS context: ~50 ms of CPU loading the CA
    bundle, for the tests' thousands of calls to http:// servers, which never use it. In the test processes
    (not the servers they start) clients built with the default verification share one context, as httpx's docs
    suggest for many clients; any other verify or cert argument builds its own as before."""
    from httpx._transports import default

    build = getattr(default, "create_ssl_context", None)
    if build is None or getattr(build, "shared", False):
        return
    made: dict[tuple, object] = {}

    def create_ssl_context(verify=True, cert=None, trust_env=True):
        if verify is not True or cert is not None:
            return build(verify=verify, cert=cert, trust_env=trust_env)
        key = (trust_env, *(os.environ.get(k) for k in ("SSL_CERT_FILE", "SSL_CERT_DIR") if trust_env))
        if key not in made:
            made[key] = build(verify=verify, cert=cert, trust_env=trust_env)
        return made[key]

    create_ssl_context.shared = True  # type: ignore[attr-defined]
    default.create_ssl_context = create_ssl_context


_one_default_tls_context()


def start_server(
    *args: str,
    timeout: float = 180.0,
    defaults: tuple[str, ...] = SERVER_DEFAULTS,
    command: str = "serve",
    head: tuple[str, ...] = (),
    fresh: bool = False,
) -> tuple[str, subprocess.Popen | ForkedServer]:
    """Start `rlserve serve` on a free port; return (base_url, process) once /health is 200.

    `args` are config overrides (`--section.key value`); they win over SERVER_DEFAULTS. `head` goes right
    after the command (a vLLM launch line's positional model). The server is forked from a process that
    imported the server stack once (forked_servers); `fresh` execs `python -m rlserve.cli` instead, for tests
    of how a process starts (so does an environment that sets what that process read as it loaded).
    The caller owns the process: stop it with `stop_server`.
    """
    fd, log_path = tempfile.mkstemp(prefix="rlserve-test-server-", suffix=".log")
    env = {k: v for k, v in os.environ.items() if k not in ("RLSERVE_API_KEY", "VLLM_API_KEY")}
    argv = [
        command,
        *head,
        "--server.host",
        "127.0.0.1",
        "--server.port",
        "0",
        *defaults,
        *args,
    ]
    with os.fdopen(fd, "wb") as log:
        if not fresh and can_fork_with(env):
            proc = ForkedServer(argv, env, Path(log_path))
        else:
            cmd = [sys.executable, "-m", "rlserve.cli", *argv]
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
            proc.log_path = Path(log_path)  # type: ignore[attr-defined]
    deadline, url = time.monotonic() + timeout, None
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with code {proc.returncode}:\n{server_log(proc)}")
            if url is None:
                match = _URL_LINE.search(server_log(proc))
                url = match.group(1) if match else None
            if url is not None:
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        return url, proc
                except httpx.HTTPError:
                    pass
            time.sleep(0.1)
        raise RuntimeError(f"server not healthy after {timeout:.0f}s:\n{server_log(proc)}")
    except BaseException:
        stop_server(proc)
        raise


def assert_documented_error(case: str, route: str, status: int, fragment: str) -> None:
    """docs/errors.md has exactly one row for `case`, naming the route, the status and the message fragment."""
    docs = (Path(__file__).resolve().parents[1] / "docs" / "errors.md").read_text()
    lines = [line for line in docs.splitlines() if line.startswith(f"| {case} |")]
    assert len(lines) == 1, f"docs/errors.md needs one row for {case!r}"
    assert f"`{route}`" in lines[0] and f"| {status} |" in lines[0] and f"`{fragment}`" in lines[0], lines[0]


def wait_queued(url: str, n: int, timeout: float = 120.0) -> None:
    """Poll until `n` requests wait in the (paused) server's queue: a hang guard, not a speed budget. From async
    code run it with asyncio.to_thread, so the requests it waits for can be sent meanwhile."""
    deadline = time.monotonic() + timeout
    while httpx.get(f"{url}/metrics", params={"format": "json"}, timeout=60).json()["queue_depth"] < n:
        assert time.monotonic() < deadline, f"{n} requests never reached the queue"
        time.sleep(0.01)


def server_log(proc: subprocess.Popen | ForkedServer) -> str:
    path = getattr(proc, "log_path", None)
    return path.read_text(errors="replace") if path is not None and path.exists() else ""


def stop_server(proc: subprocess.Popen | ForkedServer) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    drop_log(proc)


def drop_log(proc: subprocess.Popen | ForkedServer, tail: int = 12000) -> None:
    """Delete a started process's log, its tail first copied to stderr: pytest shows that only for a test that
    failed, where it is often the one account of what the process saw."""
    path = getattr(proc, "log_path", None)
    if path is None:
        return
    text = server_log(proc)
    if text:
        sys.stderr.write(f"--- the last of {path.name} (pid {proc.pid}) ---\n{text[-tail:]}\n")
    path.unlink(missing_ok=True)


@pytest.fixture(autouse=True, scope="module")
def torch_threads_as_found() -> Iterator[None]:
    """An engine run in this process with `engine.num_threads` sets torch's thread count for the whole process;
    the next module in this worker starts from the count it found, not from the last module's."""
    torch = sys.modules.get("torch")
    found = torch.get_num_threads() if torch is not None else None
    yield
    if found is not None and torch.get_num_threads() != found:
        torch.set_num_threads(found)


@pytest.fixture(scope="session")
def server() -> Iterator[str]:
    """Base URL (no /v1) of one default server shared by the whole session."""
    url, proc = start_server()
    try:
        yield url
    finally:
        stop_server(proc)


def make_variant(preset: str, out: Path, seed: int = 0, **changes) -> Path:
    """A preset's model with some of its config changed (`num_hidden_layers=2`), under the name `out` ends in."""
    from rlserve.model.make import PRESETS, make_model

    assert out.name not in PRESETS, f"{out.name!r} names a preset: the variant would replace it, then delete it"
    PRESETS[out.name] = {**PRESETS[preset], **changes}
    try:
        return make_model(out.name, out, seed)
    finally:
        del PRESETS[out.name]


def cache_of_its_own(path: Path) -> Path:
    """`path` as a subprocess's RLSERVE_CACHE_DIR: its models and files its own, the C kernels this machine built
    shared (a build is ~9 s of CPU; test_cpu_kernels builds into an empty cache itself)."""
    from rlserve.model.make import cache_root

    shared = cache_root() / "kernels"
    shared.mkdir(parents=True, exist_ok=True)
    path.mkdir(parents=True, exist_ok=True)
    if not (path / "kernels").exists():
        (path / "kernels").symlink_to(shared, target_is_directory=True)
    return path


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """The tiny model, made once; test files that need another model override this fixture."""
    from rlserve.model.make import make_model

    return make_model("tiny", tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="module")
def hf(model_dir: Path):
    """transformers' fp32 model of this module's `model_dir`, the reference for logprobs."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """This module's weight root: what a server started with `--weight_roots [root]` may load."""
    return tmp_path_factory.mktemp("weights")


@pytest.fixture(scope="module")
def peft_adapter(root: Path):
    """(directory, peft model) of a rank-4 LoRA adapter on the tiny model, saved under `root`."""
    import torch  # imported here: files that need no model should not pay for torch at collection
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from rlserve.model.make import make_model

    base = make_model("tiny", root / "lora-base", seed=0)
    torch.manual_seed(7)
    peft = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
        LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False),
    ).eval()
    path = root / "adapter"
    peft.save_pretrained(path)
    return path, peft


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--soak-minutes",
        type=float,
        default=0.0,
        help="run tests/test_soak.py for this many minutes instead of its CI-sized fixed workload",
    )


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """--dist loadfile with the modules that start a local Ray cluster as one unit of work. A 2-core machine hosts
    such a cluster one at a time (deploy_helpers' local_ray_cluster waits for the other's), so one xdist worker runs
    those modules in turn while the other runs the rest, instead of one waiting minutes for the other's cluster."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    ray_modules = {p.name for p in Path(__file__).parent.glob("test_*.py") if "local_ray_cluster(" in p.read_text()}

    class RayModulesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = super()._split_scope(nodeid)
            return "ray-cluster modules" if Path(module).name in ray_modules else module

    return RayModulesTogether(config, log)
