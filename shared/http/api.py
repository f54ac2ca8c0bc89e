"""The OpenAI-compatible HTTP API: a FastAPI app factory that only translates HTTP to `Service`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from shared.assembly import start_service
from shared.engine.contract import Engine, EngineFactory
from shared.engine.vllm_startup import open_engine
from shared.errors import (
    BundleError,
    Cancelled,
    EngineUnavailable,
    Forbidden,
    InvalidRequest,
    NotFound,
    Overloaded,
    RequestTooLarge,
    Unauthorized,
)
from shared.generation.replay import WriteNow
from shared.generation.subscription import Subscription
from shared.http.headers import (
    HeaderGuard,
    accepts_event_stream,
    admission_seconds,
    bearer_token_matches,
    parse_last_event_id,
    parse_request_id,
)
from shared.http.requests import (
    SERVER_SEND_KEY,
    SSE_HEADERS,
    EventStreamResponse,
    check_admission,
    read_json,
    service_of,
)
from shared.http.responses_api import add_routes as add_responses_routes
from shared.http.telemetry import RequestTelemetry
from shared.obs import request_traces
from shared.responses.manager import Responses
from shared.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadAdapterRequest,
    UnloadAdapterRequest,
    parse_request,
)
from shared.server_state import ExitRequest, ServerState
from shared.settings import Settings
from shared.streaming import Kind

PUBLIC_PATHS = frozenset({"/health"})


def create_app(
    settings: Settings | None = None,
    *,
    engine: Engine | None = None,
    engine_factory: EngineFactory = open_engine,
    request_exit: ExitRequest | None = None,
) -> FastAPI:
    """Build the app. With `engine`, the caller owns its lifetime and warm-up (tests sharing one
    engine); otherwise the app's lifespan opens one with `engine_factory`, warms it up unless
    BUNDLE_WARM_UP=0 (or it was warmed before a snapshot), and shuts it down after.
    `request_exit(code)` is called when the engine has died and the in-flight streams have been
    told: the server should then exit with that code (see shared/server_state.py)."""
    settings = settings or Settings()
    server_state = ServerState(settings.shutdown_grace_s, request_exit)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The one assembly (shared/assembly.py): engine, warm-up, guard, watchdog, loop lag.
        assembled = start_service(
            settings, engine=engine, engine_factory=engine_factory, server_state=server_state
        )
        async with assembled as service:
            app.state.service = service
            if app.state.server_internals is not None:
                service.metrics.show_server_features(app.state.server_internals.found)
            app.state.responses = Responses(service)
            try:
                yield
            finally:
                await app.state.responses.aclose()

    app = BundleApp(title="vllm-serverless-bundle", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.settings = settings
    app.state.server_state = server_state
    # What uvicorn and Starlette offer of their internals, as the bundle's own server process
    # checked it (shared/http/process.py); None where another server runs the app (Modal's, a
    # test's): that check would not describe what serves it.
    app.state.server_internals = None
    _install_error_handlers(app)
    _add_routes(app, settings)
    if settings.api_key is not None:
        app.add_middleware(BearerAuth, api_key=settings.api_key.get_secret_value())
    # Added last, so outermost: bounded headers are checked before auth and every route.
    app.add_middleware(HeaderGuard, max_count=settings.max_header_count, max_bytes=settings.max_header_bytes)
    # Around even that: every answer counted by status, a traced request's span (OTLP on).
    app.add_middleware(RequestTelemetry)
    return app


# --- routes -------------------------------------------------------------------------------------
def _add_routes(app: FastAPI, settings: Settings) -> None:
    @app.get("/health")
    async def health(request: Request) -> Response:
        service = service_of(request)
        if not service.ready():
            asleep = service.healthy()  # alive but not ready: asleep (a snapshot being restored)
            raise EngineUnavailable("the engine is asleep" if asleep else "the engine is not running")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        body = service_of(request).metrics.exposition()
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": service_of(request).model_cards()})

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        _check_adapter_routes_guarded(settings)
        body = parse_request(LoadAdapterRequest, await read_json(request, settings))
        adapter = await service_of(request).adapters.load(body.lora_name, body.lora_path)
        # vLLM's own answer, word for word: its clients read the status, some the text.
        return PlainTextResponse(f"Success: LoRA adapter '{adapter.name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        _check_adapter_routes_guarded(settings)
        body = parse_request(UnloadAdapterRequest, await read_json(request, settings))
        adapter = await service_of(request).adapters.unload(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{adapter.name}' removed successfully.")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        check_admission(request)
        body = parse_request(ChatCompletionRequest, await read_json(request, settings))
        return await _respond(request, "chat", body)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        check_admission(request)
        body = parse_request(CompletionRequest, await read_json(request, settings))
        return await _respond(request, "completion", body)

    @app.post("/v1/requests/{request_id}/cancel")
    async def cancel(request: Request, request_id: str) -> Response:
        request_id = parse_request_id(request_id, param="request_id") or ""
        outcome = await service_of(request).cancel(request_id)
        return JSONResponse({"id": outcome.request_id, "object": "request.cancel", "status": outcome.status})

    add_responses_routes(app, settings)


def _check_adapter_routes_guarded(settings: Settings) -> None:
    """The adapter routes make the server read a path or fetch a URL that the caller names, so
    they are served only behind an API key (vLLM's own server keeps them off unless an
    environment variable allows them): without one, anyone who can reach the port could probe
    the file system or make the server fetch from its private network."""
    if settings.api_key is None:
        raise Forbidden(
            "loading adapters at runtime needs BUNDLE_API_KEY: the route reads paths and fetches "
            "URLs that the caller names",
            code="api_key_required",
        )


async def _respond(request: Request, kind: Kind, body: ChatCompletionRequest | CompletionRequest) -> Response:
    service = service_of(request)
    request_id = parse_request_id(request.headers.get("x-request-id"))
    # SSE `id:` lines only for a client that asked for SSE proper (shared/http/headers.py says why).
    event_ids = accepts_event_stream(request.headers.get("accept"))
    last_event_id = _last_event_id(request)
    subscription = await service.open(kind, body, request_id, last_event_id, event_ids=event_ids)
    try:
        await subscription.admitted()  # bad input found while rendering is a 4xx, never a 200
    except BaseException:
        subscription.close()
        raise
    service.metrics.admission.observe(admission_seconds(request.scope))
    request_traces.note_admitted()
    headers = {"X-Request-Id": request_id} if request_id else {}
    if not subscription.stream:
        return await _whole_response(request, subscription, headers)
    settings = service.settings
    pacing = service.pacing.events_per_write if service.pacing.pairs_writes else None
    coalesce_s = settings.stream_coalesce_ms / 1000
    fallback = service.metrics.count_direct_write_fallback if settings.stream_direct_writes else None

    def events(write_now: WriteNow | None) -> AsyncIterator[bytes]:
        return subscription.events(coalesce_s, pacing, write_now)

    return EventStreamResponse(events, headers={**SSE_HEADERS, **headers}, direct_write_fallback=fallback)


def _last_event_id(request: Request) -> int | None:
    return parse_last_event_id(request.headers.get("last-event-id"))


async def _whole_response(request: Request, subscription: Subscription, headers: dict[str, str]) -> Response:
    """Wait for the whole body, or for the client to leave: then close at once, so an anonymous
    generation is aborted now (one with an id gets the grace window, as streams do)."""
    waiting = asyncio.create_task(subscription.response())
    leaving = asyncio.create_task(_disconnected(request))
    try:
        await asyncio.wait({waiting, leaving}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        leaving.cancel()
        subscription.close()  # before reading the result: a leaving client must not wait on it
        if not waiting.done():
            waiting.cancel()
        await asyncio.gather(waiting, leaving, return_exceptions=True)
    if waiting.cancelled():
        return Response(status_code=499)  # nobody is there to read it
    return JSONResponse(waiting.result(), headers=headers)


async def _disconnected(request: Request) -> None:
    """Return when the client goes away (the body has been read: only `http.disconnect` is left)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class BundleApp(FastAPI):
    """The FastAPI app, keeping the server's own `send` in each request's scope for
    `EventStreamResponse` (nothing else in the app needs or touches it)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[SERVER_SEND_KEY] = send
        await super().__call__(scope, receive, send)


# --- auth ---------------------------------------------------------------------------------------
class BearerAuth:
    """Pure ASGI middleware (no buffering, so streaming and disconnects pass straight through)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        error = Unauthorized("missing or invalid API key: send 'Authorization: Bearer <key>'")
        response = JSONResponse(error.to_openai(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def _allowed(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                return bearer_token_matches(value, self.api_key)
        return False


# --- errors -------------------------------------------------------------------------------------
def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(BundleError)
    async def bundle_error(request: Request, exc: BundleError) -> Response:
        headers = {}
        if isinstance(exc, Overloaded):
            headers["Retry-After"] = str(exc.retry_after_s)
        if isinstance(exc, RequestTooLarge):
            # The rest of the body is not wanted: uvicorn closes after the answer instead of
            # reading it to reach the next request (shared/http/limits.py, LingeringClose).
            headers["Connection"] = "close"
        # 429s are counted where they are raised; a cancelled generation (499) had reached the
        # engine and is counted as aborted, not as refused.
        if exc.status_code < 500 and not isinstance(exc, Overloaded | Cancelled):
            _count_rejection(request, exc.status_code)
        return JSONResponse(exc.to_openai(), status_code=exc.status_code, headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        error = NotFound(f"{request.method} {request.url.path}: {exc.detail}")
        error.status_code = exc.status_code
        return JSONResponse(error.to_openai(), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        error = InvalidRequest(str(exc.errors()[0].get("msg", "invalid request")))
        return JSONResponse(error.to_openai(), status_code=400)


def _count_rejection(request: Request, status: int) -> None:
    service = getattr(request.app.state, "service", None)
    if service is not None:
        service.metrics.count_rejection(status)
