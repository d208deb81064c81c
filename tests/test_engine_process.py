"""The engine core in its own process: what crosses the wire, and what happens when either side dies."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import msgspec
import pytest

from conftest import start_server, stop_server
from rlserve.config.schema import Config
from rlserve.engine.outputs import CompletionOutput, RequestOutput, VersionSpan
from rlserve.engine.params import SamplingParams
from rlserve.runtime import ipc

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for child processes")
HANG_GUARD_S = 60  # generous: only stops a hung test, never measures speed


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def engine_pids(server: subprocess.Popen) -> list[int]:
    return [c for c in children(server.pid) if b"rlserve.runtime.core" in Path(f"/proc/{c}/cmdline").read_bytes()]


def engine_pid(server: subprocess.Popen) -> int:
    (pid,) = engine_pids(server)
    return pid


def gone(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return status in ("Z", "X")  # exited, waiting for a reaper that is not us


def wait_until(cond, what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not cond():
        assert time.monotonic() < deadline, f"hang guard: {what}"
        time.sleep(0.05)


def test_messages_carry_every_dataclass_field_and_never_unpickle():
    params = SamplingParams(
        n=2,
        temperature=0.5,
        top_k=3,
        logit_bias={7: -1.5},
        seed=9,
        stop=["x"],
        stop_token_ids=[2],
        logprobs=2,
        prompt_logprobs=-1,
        logprobs_mode="raw",
        forced_token_ids=[1, 2],
        max_tokens=4,
        min_tokens=1,
    )
    add = ipc.Add(3, "r", [1, 2, 3], params, "salt", None, False)
    assert ipc.to_engine.decode(ipc.encode(add)) == add
    out = RequestOutput(
        "r",
        [1, 2],
        [
            CompletionOutput(
                0,
                [5, 6],
                "ab",
                [-0.5, -1.0],
                [{5: -0.5}, {6: -1.0, 4: -2.0}],
                "stop",
                "b",
                [VersionSpan(0, 0, 1), VersionSpan(1, 1, 2)],
            )
        ],
        [None, {2: -3.0}],
        1,
        True,
        [None, {2: 4}],
    )
    state = ipc.State(1, "v1", {"a": "/p"}, False, {"num_running": 1})
    msg = ipc.Outputs([ipc.Delta(3, out, [(0, 0)], False)], state)
    assert ipc.to_server.decode(ipc.encode(msg)) == msg
    # bad values are refused by the same checks as an HTTP request's; pickles are just bytes
    with pytest.raises(msgspec.ValidationError, match="temperature"):
        ipc.to_engine.decode(
            ipc.encode(ipc.Add(1, "r", [1], {**msgspec.to_builtins(params), "temperature": -1}, None, None, True))
        )
    import pickle

    with pytest.raises(msgspec.DecodeError):
        ipc.to_engine.decode(pickle.dumps(add.params))


@linux_only
def test_killed_engine_process_gives_503_and_fails_in_flight_requests():
    url, proc = start_server()
    try:
        core = engine_pid(proc)
        with httpx.Client(base_url=url, timeout=HANG_GUARD_S) as http:
            assert http.post("/pause", params={"mode": "keep"}).status_code == 200
            results: dict[str, httpx.Response] = {}

            def send(name: str, stream: bool) -> None:
                results[name] = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 8, "stream": stream})

            threads = [threading.Thread(target=send, args=(n, n == "stream")) for n in ("plain", "stream")]
            for t in threads:
                t.start()
            # both are queued in the engine (held by the pause) before it dies
            wait_until(lambda: _waiting(http) == 2, "requests queued")
            os.kill(core, signal.SIGKILL)
            for t in threads:
                t.join(HANG_GUARD_S)
                assert not t.is_alive(), "hang guard: in-flight request never ended"
            for name, resp in results.items():
                assert resp.status_code == 503, (name, resp.text)
                assert "engine" in resp.json()["error"]["message"]
        # until the server has exited (code 3, docs/faults.md) new requests are refused at once, never queued
        while proc.poll() is None:
            try:
                resp = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=HANG_GUARD_S)
            except httpx.TransportError:
                break  # the listening socket closed: the server is on its way out
            assert resp.status_code == 503, resp.text
        assert proc.wait(timeout=HANG_GUARD_S) == 3
    finally:
        stop_server(proc)


def _waiting(http: httpx.Client) -> int:
    return int(http.get("/metrics", params={"format": "json"}).json()["queue_depth"])


@linux_only
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_server_going_away_stops_the_engine_process(sig):
    url, proc = start_server(fresh=True)  # the command line a user runs: its signal handling from the start
    try:
        core = engine_pid(proc)
        proc.send_signal(sig)
        proc.wait(HANG_GUARD_S)
        wait_until(lambda: gone(core), f"engine process {core} outlived the server ({sig.name})")
    finally:
        stop_server(proc)


@linux_only
def test_an_engine_process_whose_server_died_before_it_looked_exits(model_dir, tmp_path):
    """The server dies while its engine process is still importing, so by the time the engine process
    looks it has already been reparented and os.getppid() no longer names the server: only the pid the
    server handed down tells it that nobody will ever read its outputs."""
    config = Config()
    config.model.name = str(model_dir)
    short_lived_server = textwrap.dedent(f"""
        import subprocess, sys
        from rlserve.runtime.spawn import child_env
        proc = subprocess.Popen([sys.executable, "-m", "rlserve.runtime.core", "ipc://{tmp_path}/in", "ipc://{tmp_path}/out"],
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env=child_env())
        proc.stdin.write(sys.stdin.buffer.read())
        proc.stdin.close()
        print(proc.pid, flush=True)
    """)
    launched = subprocess.run(
        [sys.executable, "-c", short_lived_server],
        input=config.model_dump_json().encode(),
        capture_output=True,
        check=True,
        timeout=HANG_GUARD_S,
    )
    core = int(launched.stdout)
    try:
        wait_until(lambda: gone(core), f"engine process {core} outlived the server that started it")
    finally:
        if not gone(core):
            os.kill(core, signal.SIGKILL)


def test_engine_start_failure_is_reported():
    with pytest.raises(RuntimeError) as info:
        start_server("--engine.kv_cache_bytes", "1024")
    assert "rlserve: error: the KV cache holds" in str(info.value)


def test_in_thread_engine_still_serves():
    url, proc = start_server("--engine.core_process", "false")
    try:
        if sys.platform.startswith("linux"):
            assert engine_pids(proc) == []
        resp = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=HANG_GUARD_S)
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
    finally:
        stop_server(proc)


def test_a_message_the_engine_refuses_rejects_that_request_and_the_engine_keeps_serving():
    # found by the fuzzer: a value the engine's own checks refuse on decode killed the core
    import asyncio

    from rlserve.config.schema import Config
    from rlserve.runtime.proc_client import EngineClient

    config = Config()
    config.model.max_model_len = 128
    config.engine.kv_cache_bytes = 8 << 20
    client = EngineClient(config)

    async def main() -> tuple[str, int]:
        await client.start()
        bad = SamplingParams(max_tokens=2)
        bad.repetition_penalty = 0.0  # past the server-side check: only the core's decode sees it
        with pytest.raises(ValueError, match="repetition_penalty"):
            async for _ in client.generate([1, 2, 3], bad, "bad"):
                pass
        last = None
        async for out in client.generate([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True), "good"):
            last = out
        return (last.outputs[0].finish_reason, len(last.outputs[0].token_ids))

    try:
        reason, tokens = asyncio.run(asyncio.wait_for(main(), HANG_GUARD_S))
        assert (reason, tokens) == ("length", 2) and client.dead is None
    finally:
        client.shutdown()


def _marked(mark: str) -> list[int]:
    """Processes whose environment holds `mark` (children inherit it): what a run left behind."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and not gone(int(entry.name)):
            try:
                if mark.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:  # exited meanwhile, or not ours to read
                pass
    return found


@linux_only
def test_a_server_that_refuses_its_config_stops_the_engine_it_started_early(model_dir, tmp_path):
    """rlserve.cli starts the engine process before it imports the server stack, so that the two import
    side by side. A server that refuses its config after that (here the openai tool parser without its
    vocabulary, found by the server's checks) exits non-zero saying what to change and leaves no process
    behind."""
    mark = f"RLSERVE_TEST_RUN={os.getpid()}-{time.monotonic_ns()}"
    env = {**os.environ, mark.split("=")[0]: mark.split("=")[1], "TIKTOKEN_ENCODINGS_BASE": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, "-m", "rlserve.cli", "serve", "--server.port", "0", "--model.name", str(model_dir),
         "--model.tool_call_parser", "openai"],
        env=env, capture_output=True, text=True, timeout=HANG_GUARD_S,
    )  # fmt: skip
    assert run.returncode != 0
    assert "TIKTOKEN_ENCODINGS_BASE" in run.stderr, run.stderr[-2000:]
    wait_until(lambda: not _marked(mark), "processes of the refused server outlived it")


def test_threads_beyond_the_cores_are_refused_before_any_engine_process_starts(model_dir):
    """num_threads above the cores on one rank: refused saying what to change, by rlserve.cli before it starts
    the engine process, which would start that many OpenMP threads (a mistyped 100000 took every free PID of
    a 2-core machine for a moment, and other processes failed to start threads)."""
    threads = (os.cpu_count() or 1) + 1
    run = subprocess.run(
        [sys.executable, "-m", "rlserve.cli", "serve", "--server.port", "0", "--model.name", str(model_dir),
         "--num_threads", str(threads)],
        capture_output=True, text=True, timeout=HANG_GUARD_S,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr[-2000:]
    assert f"num_threads={threads} oversubscribes" in run.stderr and "lower num_threads" in run.stderr, run.stderr


def test_a_call_to_an_engine_process_that_is_gone_raises_engine_dead(model_dir):
    """A SIGTERM to a server's whole process group (a deployment stopping its replicas) stops its engine
    process too, and the server's drain then calls an engine that is gone before the watcher has noticed.
    That call must fail as EngineDeadError (the drain's cue to stop), not with ZeroMQ's EAGAIN, which left
    the drain hung and the server to be SIGKILLed with its socket directory behind."""
    from rlserve.runtime.face import EngineDeadError
    from rlserve.runtime.proc_client import EngineClient

    config = Config()
    config.model.name = str(model_dir)
    config.engine.kv_cache_bytes = 64 << 20
    client = EngineClient(config)  # its event-loop tasks never start: nobody watches the process
    try:
        client.proc.kill()
        client.proc.wait()

        async def call_until_refused() -> BaseException:
            deadline = time.monotonic() + HANG_GUARD_S
            while time.monotonic() < deadline:
                try:  # sent while ZeroMQ has not yet dropped the dead peer: no reply ever comes, ask again
                    await asyncio.wait_for(client.has_unfinished(), timeout=0.1)
                except asyncio.TimeoutError:
                    continue
                except BaseException as exc:
                    return exc
            raise AssertionError("hang guard: calls to a dead engine were never refused")

        assert isinstance(asyncio.run(call_until_refused()), EngineDeadError)
    finally:
        client.shutdown()


@linux_only
@pytest.mark.parametrize("core_start", ["fork", "spawn"])
def test_sigterm_while_the_server_starts_stops_its_engine_and_leaves_nothing(model_dir, core_start):
    """The engine process starts before the server stack is imported, so a SIGTERM (a deployment stopping a
    replica it just started) can come while the server is still starting. The server then stops the engine
    and removes its socket directory before it exits, instead of leaving the engine to die with it. Forked
    (the default), the engine names itself; spawned, it is `python -m rlserve.runtime.core`."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlserve.cli", "serve", "--server.port", "0", "--model.name", str(model_dir),
         "--engine.core_start", core_start],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_until(lambda: engine_pids(proc) or proc.poll() is not None, "the engine process to start")
        core = engine_pid(proc)
        args = Path(f"/proc/{core}/cmdline").read_bytes().decode().replace("\0", " ").split()
        if core_start == "fork":
            assert args[0] == "rlserve.runtime.core", args
        else:
            assert args[:3] == [sys.executable, "-m", "rlserve.runtime.core"], args
        socket_dir = Path(next(a for a in args if a.startswith("ipc://"))[len("ipc://") :]).parent
        assert socket_dir.is_dir()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=HANG_GUARD_S)  # 143 while starting; 0 if it was already serving
        wait_until(lambda: gone(core), "the engine process to exit")
        assert not socket_dir.exists()
    finally:
        stop_server(proc)


def test_a_server_with_threads_running_spawns_its_engine_instead_of_forking():
    """A thread could hold a lock the forked child would wait on forever: EngineProcess(fork=True) spawns then."""
    from rlserve.runtime.spawn import can_fork

    assert can_fork() == (sys.platform.startswith("linux") and threading.active_count() == 1)
    done = threading.Event()
    thread = threading.Thread(target=done.wait)
    thread.start()
    try:
        assert not can_fork()
    finally:
        done.set()
        thread.join()


@linux_only
def test_a_forked_engine_s_exit_code_is_read_once_however_many_threads_ask():
    """ForkedProcess stands in for Popen: the client's watcher thread and stop() may poll at once."""
    from concurrent.futures import ThreadPoolExecutor

    from rlserve.runtime.spawn import ForkedProcess

    pid = os.fork()
    if pid == 0:
        time.sleep(0.2)
        os._exit(3)
    child = ForkedProcess(pid)
    with ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(lambda _: child.wait(timeout=HANG_GUARD_S), range(8)))
    assert codes == [3] * 8 and child.poll() == 3
    pid = os.fork()
    if pid == 0:
        time.sleep(HANG_GUARD_S)
        os._exit(0)
    child = ForkedProcess(pid)
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0)
    child.kill()
    assert child.wait(timeout=HANG_GUARD_S) == -signal.SIGKILL


# An engine start in a child process, its EngineProcess._socket replaced by `interruption` (the text defining
# `interrupted(self, kind, addr)`): what it raised, then whether the forked engine and its socket directory are gone
_INTERRUPTED_START = """
import os, signal, sys, tempfile
from rlserve.config.schema import Config
from rlserve.runtime import spawn
from rlserve.server import early_stop

made, forked = [], []
mkdtemp, fork_core, make_socket = tempfile.mkdtemp, spawn.fork_core, spawn.EngineProcess._socket
tempfile.mkdtemp = lambda **kw: made.append(mkdtemp(**kw)) or made[-1]
spawn.fork_core = lambda *a: forked.append(fork_core(*a)) or forked[-1]
{interruption}
spawn.EngineProcess._socket = interrupted
config = Config()
config.model.name = sys.argv[1]
try:
    spawn.EngineProcess(config, fork=True)
except (KeyboardInterrupt, SystemExit) as exc:
    print("raised", type(exc).__name__, getattr(exc, "code", None))
(child,) = forked
assert child is not None and child.returncode is not None, "the forked engine was not stopped"
assert not os.path.exists(made[0]), "the socket directory is left"
print("ok", child.returncode)
"""


def _interrupted_start(tmp_path: Path, model_dir: Path, interruption: str, timeout: float) -> str:
    script = tmp_path / "interrupted.py"
    script.write_text(_INTERRUPTED_START.format(interruption=textwrap.dedent(interruption)))
    done = subprocess.run(
        [sys.executable, str(script), str(model_dir)], capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0 and "\nok " in "\n" + done.stdout, done.stdout + done.stderr
    return done.stdout


@linux_only
def test_an_engine_start_interrupted_after_the_fork_stops_the_child_and_leaves_nothing(model_dir, tmp_path):
    """The server's SIGTERM handler raises; landing after the fork but before the sockets are bound, it
    must not leave the forked engine or its socket directory behind."""
    interruption = """
        def interrupted(self, kind, addr):
            raise KeyboardInterrupt  # as rlserve.server.early_stop's SIGTERM handler does
        """
    out = _interrupted_start(tmp_path, model_dir, interruption, timeout=120)
    assert out.startswith("raised KeyboardInterrupt None\n"), out


@linux_only
def test_a_sigterm_between_making_a_socket_and_naming_it_still_lets_the_server_exit(model_dir, tmp_path):
    """The server's SIGTERM unwinds as SystemExit wherever it lands (server/early_stop.py), also inside
    EngineProcess._socket, after ZeroMQ made the socket and before the caller holds it. Stopping then closes
    that socket too: the context's termination would otherwise wait on it forever (CI saw a server take past
    its 60 s hang guard to exit after a SIGTERM sent the moment its engine appeared)."""
    interruption = """
        def interrupted(self, kind, addr):
            sock = make_socket(self, kind, addr)
            signal.raise_signal(signal.SIGTERM)  # the handler raises here: the socket is never returned
            return sock

        signal.signal(signal.SIGTERM, early_stop.on_signal)
        """
    out = _interrupted_start(tmp_path, model_dir, interruption, timeout=HANG_GUARD_S)
    assert out.startswith(f"raised SystemExit {128 + signal.SIGTERM}\n"), out
