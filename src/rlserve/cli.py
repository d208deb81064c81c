"""`rlserve serve|make-model ...` and the prime-rl style `inference @ config.toml --key value` entry."""

from __future__ import annotations

import atexit
import os
import signal
import sys
from typing import NoReturn

from rlserve.config.load import ConfigError, help_text, load_config

USAGE = """usage: rlserve serve [@ FILE ...] [--section.key VALUE ...]
       rlserve serve MODEL [vLLM flags]  |  rlserve serve --model M [MLX server flags]   (docs/launch.md)
       rlserve make-model [--help] ...
       rlserve bench throughput|serve [--help] ...
       inference [@ FILE ...] [--section.key VALUE ...]   (same as rlserve serve)
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        print(USAGE, file=sys.stderr, end="")
        return 2
    command, rest = argv[0], argv[1:]
    if command in ("-h", "--help"):
        print(USAGE + "\n" + help_text(), end="")
        return 0
    if command in ("serve", "inference"):
        return _serve(rest, prog=f"rlserve {command}")
    if command == "bench":
        from rlserve.bench.main import main as bench_main

        return bench_main(rest)
    if command == "make-model":
        from rlserve.model.make import make_model_main

        return make_model_main(rest) or 0
    print(f"rlserve: unknown command {command!r}\n{USAGE}", file=sys.stderr, end="")
    return 2


def inference_main(argv: list[str] | None = None) -> int:
    return _serve(sys.argv[1:] if argv is None else list(argv), prog="inference")


def _serve(argv: list[str], prog: str) -> int:
    if "-h" in argv or "--help" in argv:
        print(
            f"usage: {prog} [@ FILE ...] [--section.key VALUE ...]\n"
            f"       {prog} MODEL [vLLM flags]  |  {prog} --model M [MLX server flags]   (docs/launch.md)\n\n"
            f"{help_text()}",
            end="",
        )
        return 0
    from rlserve.config.dialects import translate_launch_line

    try:
        config = load_config(translate_launch_line(argv))
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    os.environ.update(config.env_vars)  # every process started from here on inherits them
    if config.kv_cache_offload is not None and config.kv_cache_offload.type == "mooncake":
        from rlserve.deploy.mooncake import start_master_if_needed

        try:  # one for the deployment's replicas or this server; stopped at exit
            config = start_master_if_needed(config)
        except (RuntimeError, ValueError) as e:  # ValueError: kv_cache_offload.disk.path (engine/kv/disk_dir.py)
            print(f"{prog}: error: {e}", file=sys.stderr)
            return 2
    if config.deployment.enabled:
        from rlserve.deploy.run import serve_deployment

        serve_deployment(config)
        return 0
    from rlserve.runtime.machine_fit import check_before_start
    from rlserve.server.listen import check_admin_exposure

    check_admin_exposure(config)
    try:  # before the engine process starts: it would run with what these checks refuse
        check_before_start(config)
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    # until the server takes SIGTERM over (its drain), SIGTERM unwinds like Ctrl-C would: an engine process
    # already started is stopped and its socket directory removed, not left to die with this process
    from rlserve.server import early_stop

    signal.signal(signal.SIGTERM, early_stop.on_signal)
    engine_process = None
    if config.engine.core_process and not config.parallel.data_parallel:
        from rlserve.runtime.spawn import EngineProcess

        # forked after this process imports torch and the engine (one import for both), or spawned to import
        # them beside this one: either way it loads the model while this one imports the server stack
        engine_process = EngineProcess(config, fork=config.engine.core_start == "fork")
    try:
        from rlserve.server.app import serve  # imports torch and the server stack; keep --help fast
    except BaseException:
        if engine_process is not None:
            engine_process.stop()
        raise
    _exit_without_teardown(serve(config, engine_process))


def _exit_without_teardown(code: int) -> NoReturn:
    """The server has stopped what it started (its engine process, its sockets): run the atexit handlers
    (logging's flush among them) and exit without the interpreter's teardown of torch's modules, ~1 s of
    every stop here, as the engine core process does."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    raise SystemExit(main())
