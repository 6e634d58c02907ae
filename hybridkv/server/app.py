"""The FastAPI app: OpenAI routes over one engine, health, metrics, auth, limits.

Authentication: with ``api_key`` set, every ``/v1/*`` route, ``/tokenize``,
``/detokenize``, ``/reset_prefix_cache``, ``/docs`` and ``/openapi.json`` need
``Authorization: Bearer <key>`` (else 401). ``/health``, ``/metrics`` and ``/version``
stay open, as in vLLM: load balancers and Prometheus scrapers probe them without
credentials, and they reveal no prompts or outputs.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from hybridkv import __version__
from hybridkv.engine.llm_engine import LLMEngine
from hybridkv.server.async_engine import AsyncEngine
from hybridkv.server.chat import create_chat_completion
from hybridkv.server.completions import create_completion
from hybridkv.server.config import ServerConfig
from hybridkv.server.errors import APIError, install_error_handlers
from hybridkv.server.limits import BodyLimitMiddleware
from hybridkv.server.metrics import ServerMetrics
from hybridkv.server.offload import TokenizerOffload
from hybridkv.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    VersionResponse,
    dump,
)
from hybridkv.server.serving import ServingContext, now_s
from hybridkv.server.tokenize import detokenize, tokenize, tokenizer_info
from hybridkv.server.tool_parsers import HermesToolParser, ToolParser


def _auth_dependency(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    """A route dependency: 401 unless the bearer token matches (constant-time compare)."""
    expected = f"Bearer {api_key}".encode() if api_key else None

    async def check(request: Request) -> None:
        if expected is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not secrets.compare_digest(given, expected):
            raise APIError(
                "invalid or missing API key: send 'Authorization: Bearer <key>'",
                status=401,
                code="invalid_api_key",
            )

    return check


def _v1_router(ctx: ServingContext, api_key: str | None) -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=[Depends(_auth_dependency(api_key))])
    created = now_s()

    def card() -> ModelCard:
        return ModelCard(id=ctx.model_name, created=created, max_model_len=ctx.max_model_len)

    @router.get("/models")
    async def models() -> JSONResponse:
        return JSONResponse(dump(ModelList(data=[card()])))

    @router.get("/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        ctx.check_model(model_id)
        return JSONResponse(dump(card()))

    @router.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(ctx, body, request)

    @router.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(ctx, body, request)

    return router


def _tokenizer_router(ctx: ServingContext, api_key: str | None) -> APIRouter:
    """vLLM's ``/tokenize`` and ``/detokenize`` (at the root, as vLLM serves them; they
    need the API key too: they spend CPU on the caller's text)."""
    router = APIRouter(dependencies=[Depends(_auth_dependency(api_key))])

    @router.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest) -> JSONResponse:
        return JSONResponse(await tokenize(ctx, body))

    @router.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest) -> JSONResponse:
        return JSONResponse(await detokenize(ctx, body))

    @router.get("/tokenizer_info")
    async def tokenizer_info_route() -> JSONResponse:
        return JSONResponse(tokenizer_info(ctx))

    return router


def _admin_router(ctx: ServingContext, api_key: str | None) -> APIRouter:
    """vLLM's ``POST /reset_prefix_cache``: empty the prefix cache (cold-cache benchmarks);
    running requests go on unaffected. Behind the API key: it costs every client its hits."""
    router = APIRouter(dependencies=[Depends(_auth_dependency(api_key))])

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        await asyncio.to_thread(ctx.engine.reset_prefix_cache)  # waits for the step in flight
        return Response(status_code=200)

    return router


def _docs_router(app: FastAPI, api_key: str | None) -> APIRouter:
    """``/openapi.json`` and ``/docs`` (Swagger UI), behind the API key when one is set."""
    router = APIRouter(dependencies=[Depends(_auth_dependency(api_key))])

    @router.get("/openapi.json", include_in_schema=False)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @router.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="hybridkv")

    return router


def create_app(
    engine: LLMEngine | AsyncEngine,
    served_model_name: str,
    api_key: str | None = None,
    *,
    server: ServerConfig | None = None,
    tool_parser: ToolParser | None = None,
) -> FastAPI:
    """An app serving ``engine`` under ``served_model_name``.

    The engine's step thread starts with the app (ASGI lifespan) and stops with it, so the
    app must run under a server that sends lifespan events (uvicorn does).

    Args:
        engine: the engine, or an :class:`AsyncEngine` already wrapping one.
        served_model_name: the only ``model`` value requests may name (else 404).
        api_key: if set, ``/v1/*``, the tokenizer routes, ``/reset_prefix_cache`` and the
            docs need ``Authorization: Bearer <api_key>``.
        server: body size and time limits, request logging, docs (default ServerConfig()).
        tool_parser: how the model writes tool calls (default: hermes).
    """
    server = server or ServerConfig()
    front = engine if isinstance(engine, AsyncEngine) else AsyncEngine(engine)
    front.log_requests = server.enable_log_requests
    metrics = ServerMetrics(served_model_name)
    ctx = ServingContext(
        engine=front,
        model_name=served_model_name,
        metrics=metrics,
        tool_parser=tool_parser or HermesToolParser(),
    )
    tokenizer = front.engine.tokenizer
    if tokenizer is not None:
        ctx.offload = TokenizerOffload(tokenizer, front.engine.config.model)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        front.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            front.shutdown()
            if ctx.offload is not None:
                ctx.offload.shutdown()

    app = FastAPI(
        title="hybridkv", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.ctx = ctx
    install_error_handlers(app)
    app.add_middleware(
        BodyLimitMiddleware,
        max_body_bytes=server.max_body_bytes,
        body_timeout_s=server.timeout_request_body,
    )
    app.include_router(_v1_router(ctx, api_key))
    app.include_router(_tokenizer_router(ctx, api_key))
    app.include_router(_admin_router(ctx, api_key))
    if not server.disable_fastapi_docs:
        app.include_router(_docs_router(app, api_key))

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse(dump(VersionResponse(version=__version__)))

    @app.get("/health")
    async def health() -> Response:
        if not front.is_running:
            raise APIError("the engine is not running", status=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics_route() -> Response:
        stats = await asyncio.to_thread(front.stats)  # waits for the step in flight
        return Response(metrics.render(stats), media_type=CONTENT_TYPE_LATEST)

    return app
