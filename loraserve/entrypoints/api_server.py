"""The HTTP app and the life of the server process.

`serve` binds the port first (a busy port fails before any model loads),
starts the engine-core process, waits until it is ready, loads the
`--lora-modules` adapters, then serves on uvicorn. It stops the engine on the
way out, whatever the reason: a signal (after draining the requests in flight,
see shutdown.py), an error, or the engine's own death.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from loraserve import envs
from loraserve.entrypoints.core_client import AsyncEngineClient, EngineDeadError
from loraserve.entrypoints.errors import APIError, bad_request, engine_unavailable
from loraserve.entrypoints.json_body import StrictJSONRoute
from loraserve.entrypoints.middleware import (
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    OPEN_PATHS,
    BodySizeLimitMiddleware,
    GuardMiddleware,
)
from loraserve.entrypoints.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from loraserve.entrypoints.request_logger import RequestLoggingEngine
from loraserve.entrypoints.request_tokenizer import RequestTokenizer
from loraserve.entrypoints.server_args import CORSPolicy, ServerArgs, check_pinned
from loraserve.entrypoints.serving_chat import OpenAIServingChat
from loraserve.entrypoints.serving_common import ModelLimits
from loraserve.entrypoints.serving_completion import OpenAIServingCompletion
from loraserve.entrypoints.serving_models import ServingModels
from loraserve.entrypoints.serving_tokenization import OpenAIServingTokenization
from loraserve.entrypoints.shutdown import (
    Drain,
    DrainingServer,
    shutting_down_error,
)
from loraserve.entrypoints.structured_outputs import GrammarChecker
from loraserve.entrypoints.tool_parsers.base import load_tool_parser
from loraserve.lora.resolver import load_resolvers
from loraserve.metrics import CONTENT_TYPE, ServerMetrics, cache_config_labels
from loraserve.options import OptionError, flag
from loraserve.version import __version__

if TYPE_CHECKING:
    from loraserve.config import EngineConfig
    from loraserve.engine.utility import EngineReady

logger = logging.getLogger("loraserve.api_server")


@dataclass(kw_only=True)
class ServerSettings(ServerArgs):
    """Everything `loraserve serve` needs: the server's flags, the engine's config,
    validated once and handed to the engine process as it is, and what both give."""

    engine_config: EngineConfig
    served_model_names: list[str]
    # `--model` as given (a Hub id, a directory): the base model card's `root`.
    # None: the directory the model was loaded from.
    model: str | None = None
    eos_token_id: int | None = None
    # Unset request fields take these (from the model's generation_config.json).
    sampling_defaults: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Resolved here, where the flags are read: a Ray replica elsewhere gets the
        # key this process had, not its own machine's environment.
        self.api_key = self.api_key or envs.API_KEY.get() or None
        self.lora_modules = self.lora_modules or []
        self.root_path = self.root_path or ""


@dataclass
class ServerState:
    engine: AsyncEngineClient
    models: ServingModels
    completion: OpenAIServingCompletion
    chat: OpenAIServingChat
    tokenization: OpenAIServingTokenization
    metrics: ServerMetrics
    api_key: str | None
    allow_runtime_lora: bool
    drain: Drain = field(default_factory=Drain)
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    metrics_require_api_key: bool = False
    cors: CORSPolicy | None = None
    root_path: str = ""


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(request: Request, work: Awaitable[Any], drain: Drain) -> Any:
    """Run a handler, cancelling it (so its request is aborted in the engine) if
    the client goes away first; returns None then. At the shutdown deadline a
    handler that is still busy (say, rendering a slow template) is cancelled too,
    and its client gets a 503."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    deadline = asyncio.ensure_future(drain.expired.wait())
    try:
        await asyncio.wait({task, watcher, deadline}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        deadline.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        if drain.expired.is_set():
            raise shutting_down_error()
        return None
    return task.result()


def _to_response(result: Any) -> Response:
    if result is None:  # the client is gone; nobody reads this
        return Response(status_code=499)
    if isinstance(result, Response):  # a handler that sets its own headers
        return result
    if isinstance(result, BaseModel):
        return JSONResponse(result.model_dump())
    return StreamingResponse(result, media_type="text/event-stream")


def build_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        # Inside uvicorn's shutdown, before it re-raises the signal it caught.
        await state.engine.shutdown()

    app = FastAPI(title="loraserve", version=__version__, lifespan=lifespan)
    app.router.route_class = StrictJSONRoute
    app.state.server = state
    # The last added runs first: the key is checked before any body byte is read.
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=state.max_request_body_bytes)
    open_paths = OPEN_PATHS if state.metrics_require_api_key else OPEN_PATHS | {"/metrics"}
    app.add_middleware(GuardMiddleware, api_key=state.api_key, drain=state.drain,
                       engine_dead=lambda: state.engine.is_dead, open_paths=open_paths)
    if state.cors is not None:
        # Outermost: a preflight OPTIONS carries no API key, and a 401 or 413 needs
        # the CORS headers too for a browser to read it.
        app.add_middleware(CORSMiddleware, allow_origins=state.cors.allow_origins,
                           allow_methods=state.cors.allow_methods,
                           allow_headers=state.cors.allow_headers,
                           allow_credentials=state.cors.allow_credentials)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        # One line per field: a union type (like `prompt`) reports once, not per member.
        fields: dict[str, str] = {}
        for err in exc.errors():
            if err.get("type") == "json_invalid":
                detail = (err.get("ctx") or {}).get("error", "")
                fields.setdefault("body", f"not valid JSON: {detail}")
                continue
            loc = [str(p) for p in err.get("loc", ()) if p != "body"]
            fields.setdefault(loc[0] if loc else "body", str(err.get("msg")))
        message = "; ".join(f"{name}: {msg}" for name, msg in fields.items())
        param = next(iter(fields), None)
        return bad_request(message or "Invalid request.", param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return engine_unavailable().response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error in %s", request.url.path)
        return APIError(500, f"Internal error: {type(exc).__name__}: {exc}").response()

    @app.get("/health")
    async def health() -> Response:
        # 503 while draining too, so that a load balancer stops sending requests.
        healthy = not state.engine.is_dead and not state.drain.draining
        return Response(status_code=200 if healthy else 503)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse(state.models.list_models().model_dump())

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> JSONResponse:
        return JSONResponse(state.models.model_card(model_id).model_dump())

    @app.get("/v1/engine_stats")
    async def engine_stats() -> JSONResponse:
        """The scheduler's state and the bytes of adapter weights the engine holds."""
        stats = await state.engine.get_stats()
        memory = await state.engine.lora_memory_usage()
        return JSONResponse({
            "engine_pid": state.engine.engine_pid,
            "scheduler": msgspec.structs.asdict(stats),
            "lora_memory_bytes": memory,
        })

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw_request: Request) -> Response:
        work = state.completion.create_completion(body)
        return _to_response(await run_until_disconnect(raw_request, work, state.drain))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw_request: Request) -> Response:
        work = state.chat.create_chat_completion(body)
        return _to_response(await run_until_disconnect(raw_request, work, state.drain))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, raw_request: Request) -> Response:
        work = state.tokenization.tokenize(body)
        return _to_response(await run_until_disconnect(raw_request, work, state.drain))

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, raw_request: Request) -> Response:
        work = state.tokenization.detokenize(body)
        return _to_response(await run_until_disconnect(raw_request, work, state.drain))

    if state.allow_runtime_lora:

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
            return PlainTextResponse(await state.models.load_lora_adapter(body))

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
            return PlainTextResponse(await state.models.unload_lora_adapter(body))

    return app


def bind_socket(host: str | None, port: int) -> socket.socket:
    """Bind the listening socket now, so a busy port fails before the model loads."""
    family = socket.AF_INET6 if host and ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host or "0.0.0.0", port))
    sock.set_inheritable(False)
    return sock


def build_server_state(
    settings: ServerSettings,
    engine: AsyncEngineClient,
    models: ServingModels,
    request_tokenizer: RequestTokenizer,
    max_model_len: int,
    metrics: ServerMetrics,
) -> ServerState:
    """The handlers of every endpoint over one engine: `loraserve serve` and each
    engine replica of the Ray application (loraserve/ray) build them alike."""
    # Token ids a request carries must be below the model's vocabulary, which the
    # tokenizer's length need not equal.
    vocab_size = settings.engine_config.model_config.hf_config.vocab_size
    limits = ModelLimits(max_model_len, vocab_size)
    generator = (RequestLoggingEngine(engine, settings.served_model_names[0])
                 if settings.enable_log_requests else engine)
    policy = settings.engine_config.scheduler_config.policy
    grammar_checker = GrammarChecker(settings.engine_config.structured_outputs_config)
    tool_parser = (load_tool_parser(settings.tool_call_parser, settings.tool_parser_plugin)
                   if settings.enable_auto_tool_choice else None)
    chat = OpenAIServingChat(generator, models, request_tokenizer, limits,
                             settings.sampling_defaults, settings.trust_request_chat_template,
                             settings.response_role, policy, grammar_checker, tool_parser)
    return ServerState(
        engine=engine,
        models=models,
        completion=OpenAIServingCompletion(generator, models, request_tokenizer, limits,
                                           settings.sampling_defaults, policy,
                                           grammar_checker),
        chat=chat,
        tokenization=OpenAIServingTokenization(models, chat, request_tokenizer, limits),
        metrics=metrics,
        allow_runtime_lora=models.allow_runtime_updates,
        **http_settings(settings),
    )


def http_settings(settings: ServerSettings) -> dict[str, Any]:
    """The ServerState fields that come from the HTTP flags as they are."""
    return {
        "api_key": settings.api_key,
        "max_request_body_bytes": settings.max_request_body_bytes,
        "metrics_require_api_key": settings.metrics_require_api_key,
        "cors": settings.cors,
        "root_path": settings.root_path,
    }


def server_metrics(settings: ServerSettings) -> ServerMetrics:
    """The metrics of one server (or Ray replica) with these settings."""
    lora_config = settings.engine_config.lora_config
    return ServerMetrics(settings.served_model_names[0],
                         lora_config.max_loras if lora_config else None,
                         prefix=settings.metrics_prefix,
                         max_model_len=settings.engine_config.model_config.max_model_len)


def record_engine_ready(metrics: ServerMetrics, settings: ServerSettings,
                        ready: EngineReady) -> None:
    """What the metrics learn once the engine is up: the KV cache it sized, and its
    device slots (decided then with --max-loras auto)."""
    metrics.set_cache_config(cache_config_labels(settings.engine_config.cache_config,
                                                 ready.num_kv_blocks))
    if ready.max_loras:
        metrics.max_loras = ready.max_loras


async def serve(settings: ServerSettings, tokenizer: Any) -> int:
    """Run the server until a signal or the engine's death; returns the exit code."""
    sock = bind_socket(settings.host, settings.port)
    lora_config = settings.engine_config.lora_config
    metrics = server_metrics(settings)
    engine = AsyncEngineClient(tokenizer, settings.eos_token_id, metrics)
    request_tokenizer = RequestTokenizer(tokenizer)
    exit_code = 0
    loop = asyncio.get_running_loop()
    # Until uvicorn takes the signals over, SIGTERM cancels start-up (SIGINT already
    # does, through asyncio.run); the finally below still stops the engine.
    loop.add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
    try:
        timeout = float(envs.ENGINE_READY_TIMEOUT_S.get())
        logger.info("starting the engine core: loading %s on %s",
                    settings.model or settings.engine_config.model_config.model,
                    settings.engine_config.device)
        ready = await engine.start(settings.engine_config, timeout)
        record_engine_ready(metrics, settings, ready)
        logger.info("engine core ready (pid %d, max_model_len %d)", ready.pid,
                    ready.max_model_len)
        allow_runtime = envs.ALLOW_RUNTIME_LORA_UPDATING.flag()
        models = ServingModels(
            engine,
            settings.served_model_names,
            settings.model or ready.model_path,
            ready.max_model_len,
            resolvers=load_resolvers(settings.lora_resolvers) if allow_runtime else [],
            allow_runtime_updates=allow_runtime,
            max_loras=ready.max_loras or None,
        )
        if lora_config is not None and lora_config.auto_max_loras:
            # The pins could only be checked against the slots once they were sized.
            try:
                check_pinned(settings.lora_modules, ready.max_loras)
            except OptionError as exc:
                raise ValueError(exc.named(flag)) from exc
        if lora_config is not None:
            await models.init_static_loras(
                settings.lora_modules, lora_config.max_cpu_loras or ready.max_loras,
                lora_config.max_lora_rank)
        state = build_server_state(settings, engine, models, request_tokenizer,
                                   ready.max_model_len, metrics)
        config = uvicorn.Config(
            build_app(state), log_level=settings.uvicorn_log_level, timeout_keep_alive=5,
            access_log=not settings.disable_uvicorn_access_log,
            root_path=settings.root_path, ssl_keyfile=settings.ssl_keyfile,
            ssl_certfile=settings.ssl_certfile, ssl_ca_certs=settings.ssl_ca_certs,
            ssl_cert_reqs=settings.ssl_cert_reqs,
        )
        server = DrainingServer(config, state.drain, settings.shutdown_timeout,
                                engine.fail_all_requests)

        async def stop_when_engine_dies() -> None:
            nonlocal exit_code
            await engine.dead.wait()
            if server.should_exit or engine.shutting_down:
                return
            if envs.KEEP_ALIVE_ON_ENGINE_DEATH.flag():
                logger.error("the engine core died; answering 503 until stopped")
                return
            logger.error("the engine core died; shutting down the API server")
            exit_code = 1
            server.should_exit = True

        watcher = asyncio.create_task(stop_when_engine_dies())
        loop.remove_signal_handler(signal.SIGTERM)
        # uvicorn re-raises the signal it handled once it has shut down; with these
        # no-op handlers in place that ends serve() normally instead of killing us.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
        host = settings.host or "0.0.0.0"
        scheme = "https" if settings.ssl_certfile else "http"
        logger.info("serving %s on %s://%s:%d%s", ", ".join(settings.served_model_names),
                    scheme, host, settings.port, settings.root_path)
        await server.serve(sockets=[sock])
        watcher.cancel()
    finally:
        await engine.shutdown()
        request_tokenizer.shutdown()
        sock.close()
    return exit_code
