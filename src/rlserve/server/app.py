"""The FastAPI app: OpenAI routes, tokenizer routes, health and metrics; `serve` runs it on uvicorn."""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import signal
import sys
import time
from contextlib import asynccontextmanager

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Receive, Scope, Send

from rlserve.config.load import configure_logging
from rlserve.config.schema import Config, warn_unapplied
from rlserve.runtime.data_parallel import DataParallelClient, routing_hint
from rlserve.runtime.face import EngineDeadError, EngineFace, EngineUnavailableError
from rlserve.runtime.heap import freeze_startup_heap
from rlserve.runtime.inproc import AsyncEngine
from rlserve.runtime.machine_fit import check_parallel
from rlserve.runtime.proc_client import EngineClient
from rlserve.runtime.spawn import EngineProcess
from rlserve.server import early_stop
from rlserve.server.anthropic import messages as anthropic_messages
from rlserve.server.auth import Gate
from rlserve.server.engine_death import engine_died
from rlserve.server.errors import APIError, install_error_handlers
from rlserve.server.fleet import deployment_guard, worker_routes
from rlserve.server.limits import BodyGuard
from rlserve.server.listen import bind, check_admin_exposure
from rlserve.server.metrics import Metrics, wants_json_metrics
from rlserve.server.metrics_vllm import OperationTimer
from rlserve.server.openai import (
    chat,
    chat_batch,
    completions,
    responses,
    responses_store,
    sagemaker,
    tokenization,
)
from rlserve.server.openai.chat_template import load_template
from rlserve.server.openai.vllm_shape import model_permission
from rlserve.server.openapi import install_openapi
from rlserve.server.parsers.harmony import check_vocabulary
from rlserve.server.request_headers import ResponseHeaders
from rlserve.server.rl import control, generate, rescore, vllm_rl
from rlserve.server.rl import weights as vllm_weights
from rlserve.server.state import ServerState

log = logging.getLogger("rlserve.server")


router = APIRouter()


def served_model_name(config: Config) -> str:
    return config.model.served_model_name or config.model.name or "rlserve-default"


def build_app(engine: EngineFace, config: Config) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()  # the engine client reads its process's messages in this event loop
        if config.model.adapter_path:
            await control.activate_startup_adapter(app.state.rlserve, config.model.adapter_path)
        freeze_startup_heap()
        yield

    app = FastAPI(title="rlserve", redirect_slashes=False, lifespan=lifespan, root_path=config.server.root_path)
    name = served_model_name(config)
    app.state.rlserve = ServerState(
        engine, config, Metrics(engine, name), name, chat_template=load_template(config.model.chat_template)
    )
    install_error_handlers(app)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return APIError(503, str(exc), type="ServiceUnavailableError").response()

    @app.exception_handler(EngineUnavailableError)
    async def _engine_unavailable(request: Request, exc: EngineUnavailableError) -> JSONResponse:
        return APIError(503, str(exc), type="ServiceUnavailableError").response()

    install_openapi(app, _schema_limits(engine, config))
    for r in (
        router,
        completions.router,
        chat.router,
        tokenization.router,
        generate.router,
        control.router,
        responses.router,
        worker_routes.router,
        vllm_weights.router,
        rescore.router,
        vllm_rl.router,
        responses_store.router,
        chat_batch.router,
        anthropic_messages.router,
        sagemaker.router,
    ):
        app.include_router(r)
    app.add_middleware(BodyGuard, max_body_bytes=config.server.max_body_bytes)
    app.add_middleware(
        Gate, api_key=config.server.api_key, admin_api_key=config.server.admin_api_key, state=app.state.rlserve
    )
    deployment_guard.install(app)
    app.add_middleware(OperationTimer, operations=app.state.rlserve.metrics.operations)
    app.add_middleware(ResponseHeaders)  # outermost: a 401 or 413 carries X-Request-Id too
    if config.parallel.dp > 1:
        app.add_middleware(RoutingHints)
    return app


class RoutingHints:
    """Hands X-data-parallel-rank and X-Session-ID to the data-parallel client (it picks the engine)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = dict(scope.get("headers", ()))
            rank, session = headers.get(b"x-data-parallel-rank"), headers.get(b"x-session-id")
            routing_hint.set((rank and rank.decode("latin-1"), session and session.decode("latin-1")))
        await self.app(scope, receive, send)


def _schema_limits(engine: EngineFace, config: Config) -> dict[str, int]:
    """Caps of this configuration that /openapi.json states as maxima."""
    limits = {"n": config.engine.max_num_seqs}
    if config.engine.max_logprobs != -1:
        limits |= dict.fromkeys(
            ("logprobs", "top_logprobs", "top_logprobs_num", "prompt_logprobs"), config.engine.max_logprobs
        )
    vocab_max = engine.vocab_size - 1
    return limits | dict.fromkeys(("token_ids", "input_ids", "tokens", "stop_token_ids"), vocab_max)


def _state(request: Request) -> ServerState:
    return request.app.state.rlserve


def _model_card(state: ServerState) -> dict:
    config = state.config
    return {
        "id": state.served_model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "rlserve",
        "root": config.model.name or str(state.engine.model_dir),
        "parent": None,
        "max_model_len": state.max_model_len,
        "permission": [model_permission()],
    }


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    state = _state(request)
    base = _model_card(state)
    adapters = [
        {**base, "id": name, "root": path, "parent": state.served_model_name}
        for name, path in state.engine.adapters.items()
    ]
    return {"object": "list", "data": [base, *adapters]}


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request) -> dict:
    state = _state(request)
    state.check_model(model)
    return _model_card(state)


@router.get("/health")
@router.get("/liveness")
@router.get("/ping")
async def health(request: Request) -> dict:
    engine = _state(request).engine
    if engine.dead is not None:
        raise APIError(503, f"engine loop died: {engine.dead!r}")
    return {"status": "healthy", "model_loaded": True}


@router.get("/version")
async def version() -> dict:
    return {"version": importlib.metadata.version("rlserve")}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus text, or the MLX-style JSON status when JSON is asked for (§2.0 dispatch)."""
    state = _state(request)
    if wants_json_metrics(request, state.config.server.metrics_format):
        await state.engine.refresh()
        stats = state.engine.stats
        return JSONResponse(
            {
                "current_policy_version": stats.policy_version,
                "queue_depth": stats.num_waiting,
                "num_running": stats.num_running,
                "max_batch_size": state.config.engine.max_num_seqs,
                "flush_interval_ms": _number(state.config.engine.batch_window_ms),
                "is_paused": state.engine.paused,
                "weight_version": state.engine.weight_version,
                "num_steps": stats.num_steps,
            }
        )
    await state.engine.refresh()
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _number(x: float) -> float | int:
    return int(x) if float(x).is_integer() else x


def serve(config: Config, engine_process: EngineProcess | None = None) -> int:
    """Load the engine, bind host:port (0 = any free port), log the URL, and serve until SIGTERM/SIGINT,
    then drain (see DrainingServer). `engine_process`: the engine core process started for this config
    before this module was imported (rlserve.cli); adopted, or stopped when the server does not start.
    Returns the exit code: 0, or ENGINE_DIED_EXIT_CODE when the engine died under it (docs/faults.md)."""
    try:
        check_admin_exposure(config)
        configure_logging(config)
        warn_unapplied(config, log)
        try:
            check_vocabulary(config.model.tool_call_parser, config.model.reasoning_parser)
            check_parallel(config)
            if config.parallel.data_parallel:
                engine: EngineFace = DataParallelClient(config)
            elif config.engine.core_process:
                engine, engine_process = EngineClient(config, process=engine_process), None
            else:
                # the engine thread runs Python between its torch ops: hand the GIL over sooner than every 5 ms
                sys.setswitchinterval(0.0005)
                engine = AsyncEngine(config)
        except ValueError as e:  # the engine's config checks (KV cache too small, ...) say what to change
            raise SystemExit(f"rlserve: error: {e}") from None
    finally:
        if engine_process is not None:  # not adopted (EngineClient stops the one it adopted if it fails)
            engine_process.stop()
    try:
        app = build_app(engine, config)
        try:
            sock = bind(config.server.host, config.server.port)
        except OSError as e:
            raise SystemExit(
                f"rlserve: error: cannot listen on {config.server.host}:{config.server.port}: {e}"
            ) from None
        host, port = sock.getsockname()[:2]
        url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        print(f"rlserve: serving {served_model_name(config)} on {url}", flush=True)
        log.info("serving %s on %s", served_model_name(config), url)
        grace = config.server.shutdown_grace_s
        # uvicorn's own grace covers writing the responses of requests aborted at the end of ours
        uv_config = uvicorn.Config(app, log_level=config.server.log_level, timeout_graceful_shutdown=int(grace) + 5)
        server = DrainingServer(uv_config, app.state.rlserve, grace)
        early_stop.check()
        server.run(sockets=[sock])
    finally:
        engine.shutdown()
    return server.exit_code


class DrainingServer(uvicorn.Server):
    """SIGTERM or SIGINT: new requests get 503 (health too, so routers move on), in-flight requests
    run for up to `grace_s`, then the rest are aborted (finish_reason "abort") and the server exits 0.
    A second signal stops at once."""

    def __init__(self, config: uvicorn.Config, state: ServerState, grace_s: float):
        super().__init__(config)
        self.state, self.grace_s = state, grace_s
        self._drain: asyncio.Task | None = None
        self.exit_code = 0
        self.stop_asked = False

    def handle_exit(self, sig: int, frame) -> None:  # no re-raise of the signal afterwards: exit 0
        if self.state.draining:
            self.should_exit = True
            self.force_exit = sig == signal.SIGINT
        self.state.draining = self.stop_asked = True

    async def on_tick(self, counter: int) -> bool:
        if early_stop.requested is not None:  # a SIGTERM from before uvicorn took the signal over
            self.state.draining = self.stop_asked = True
        # once a stop is asked, the engine ending is part of it: a supervisor (the deployment's, systemd's control
        # group) signals the whole process group, and the engine process ends on the same SIGTERM
        if self.exit_code == 0 and self.state.engine.dead is not None and not self.stop_asked:
            self.exit_code = await engine_died(self.state)
        if self.state.draining and self._drain is None:
            log.info("shutting down: refusing new requests, %.0f s for in-flight ones", self.grace_s)
            self._drain = asyncio.ensure_future(self._drain_engine())
        return await super().on_tick(counter)

    async def _drain_engine(self) -> None:
        engine = self.state.engine
        deadline = time.monotonic() + self.grace_s
        try:
            while time.monotonic() < deadline and await engine.has_unfinished():
                await asyncio.sleep(0.05)
            aborted = await engine.abort_requests()
            if aborted:
                log.warning("shutdown grace period over: aborted %d request(s)", aborted)
        except EngineDeadError:
            pass
        except Exception:  # whatever went wrong, the server still stops
            log.exception("draining the engine failed; stopping anyway")
        finally:
            self.should_exit = True
