"""The OpenAI-compatible HTTP API: a FastAPI app factory that only translates HTTP to `Service`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from shared.assembly import EngineFactory, start_service
from shared.engine import Engine, open_engine
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
    UnsupportedMediaType,
)
from shared.headers import (
    HeaderGuard,
    accepts_event_stream,
    admission_seconds,
    bearer_token_matches,
    parse_last_event_id,
    parse_request_id,
)
from shared.identity import Subscription
from shared.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadAdapterRequest,
    UnloadAdapterRequest,
    parse_request,
)
from shared.responses.manager import Responses
from shared.server_state import ExitRequest, Lifecycle
from shared.service import Service
from shared.settings import Settings
from shared.streaming import Kind

PUBLIC_PATHS = frozenset({"/health"})
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SERVER_SEND_KEY = "bundle.server_send"  # the server's own ASGI send, in the scope (BundleApp)


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
    lifecycle = Lifecycle(settings.shutdown_grace_s, request_exit)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The one assembly (shared/assembly.py): engine, warm-up, guard, watchdog, loop lag.
        assembled = start_service(settings, engine=engine, engine_factory=engine_factory, lifecycle=lifecycle)
        async with assembled as service:
            app.state.service = service
            app.state.responses = Responses(service)
            try:
                yield
            finally:
                await app.state.responses.aclose()

    app = BundleApp(title="vllm-serverless-bundle", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.settings = settings
    app.state.lifecycle = lifecycle
    _install_error_handlers(app)
    _add_routes(app, settings)
    if settings.api_key is not None:
        app.add_middleware(BearerAuth, api_key=settings.api_key.get_secret_value())
    # Added last, so outermost: bounded headers are checked before auth and every route.
    app.add_middleware(HeaderGuard, max_count=settings.max_header_count, max_bytes=settings.max_header_bytes)
    return app


# --- routes -------------------------------------------------------------------------------------
def _add_routes(app: FastAPI, settings: Settings) -> None:
    @app.get("/health")
    async def health(request: Request) -> Response:
        service = _service(request)
        if not service.ready():
            asleep = service.healthy()  # alive but not ready: asleep (a snapshot being restored)
            raise EngineUnavailable("the engine is asleep" if asleep else "the engine is not running")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        body = _service(request).metrics_text()
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": _service(request).model_cards()})

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        _check_adapter_routes_guarded(settings)
        body = parse_request(LoadAdapterRequest, await _read_json(request, settings))
        adapter = await _service(request).adapters.load(body.lora_name, body.lora_path)
        # vLLM's own answer, word for word: its clients read the status, some the text.
        return PlainTextResponse(f"Success: LoRA adapter '{adapter.name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        _check_adapter_routes_guarded(settings)
        body = parse_request(UnloadAdapterRequest, await _read_json(request, settings))
        adapter = await _service(request).adapters.unload(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{adapter.name}' removed successfully.")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        _check_admission(request)
        body = parse_request(ChatCompletionRequest, await _read_json(request, settings))
        return await _respond(request, "chat", body)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        _check_admission(request)
        body = parse_request(CompletionRequest, await _read_json(request, settings))
        return await _respond(request, "completion", body)

    @app.post("/v1/requests/{request_id}/cancel")
    async def cancel(request: Request, request_id: str) -> Response:
        request_id = parse_request_id(request_id, param="request_id") or ""
        outcome = await _service(request).cancel(request_id)
        return JSONResponse({"id": outcome.request_id, "object": "request.cancel", "status": outcome.status})

    from shared.responses.routes import add_routes  # it imports this module's helpers

    add_routes(app, settings)


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


def _service(request: Request) -> Service:
    service: Service | None = getattr(request.app.state, "service", None)
    if service is None:
        raise EngineUnavailable("the engine is starting")
    return service


def _check_admission(request: Request) -> None:
    """New generations only while serving with a live engine: 503 before any 200 is sent."""
    service = _service(request)
    request.app.state.lifecycle.check_admission()
    if not service.healthy():
        raise EngineUnavailable("the engine is not running")


def _check_json_content_type(request: Request) -> None:
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        raise UnsupportedMediaType(
            "send the request body as JSON with 'Content-Type: application/json'", param="Content-Type"
        )


async def _read_json(request: Request, settings: Settings) -> Any:
    """Read the body with a hard cap (413) and decode it (400), before any other work."""
    _check_json_content_type(request)
    limit = settings.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestTooLarge(f"request body exceeds {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestTooLarge(f"request body exceeds {limit} bytes")
        chunks.append(chunk)
    try:
        return orjson.loads(b"".join(chunks))
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None


async def _respond(request: Request, kind: Kind, body: ChatCompletionRequest | CompletionRequest) -> Response:
    service = _service(request)
    request_id = parse_request_id(request.headers.get("x-request-id"))
    # SSE `id:` lines only for a client that asked for SSE proper (shared/headers.py says why).
    event_ids = accepts_event_stream(request.headers.get("accept"))
    last_event_id = _last_event_id(request)
    subscription = await service.open(kind, body, request_id, last_event_id, event_ids=event_ids)
    try:
        await subscription.admitted()  # bad input found while rendering is a 4xx, never a 200
    except BaseException:
        subscription.close()
        raise
    service.record_admission(admission_seconds(request.scope))
    headers = {"X-Request-Id": request_id} if request_id else {}
    if not subscription.stream:
        return await _whole_response(request, subscription, headers)
    settings = service.settings
    pacing = service.events_per_write if service.pairs_writes else None
    events = subscription.events(settings.stream_coalesce_ms / 1000, pacing)
    return EventStreamResponse(events, headers={**SSE_HEADERS, **headers})


def _last_event_id(request: Request) -> int | None:
    return parse_last_event_id(request.headers.get("last-event-id"))


async def _whole_response(
    request: Request, subscription: Subscription, headers: dict[str, str]
) -> Response:
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


class EventStreamResponse(StreamingResponse):
    """SSE response that notices a client leaving even while no token is being written.

    Starlette only finds out about a disconnect on its next write under ASGI 2.4; a generation
    still queued or in a long prefill writes nothing, so we also listen for `http.disconnect`.

    Its body chunks (one per token and stream, the hottest path of the server) go to the
    server's own `send` (`BundleApp` keeps it in the scope), past the send wrappers of
    Starlette's and FastAPI's error handling: those only watch for `http.response.start`, which
    still goes through them, and pass every body message on unchanged.
    """

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body_send: Send = scope.get(SERVER_SEND_KEY, send)
        streamer = asyncio.create_task(self._stream_quietly(send, body_send))
        listener = asyncio.create_task(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({streamer, listener}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # Also when this task is cancelled (a host cancelling the request mid-write): the
            # streamer's own clean-up closes the subscription, so nothing is left running.
            for task in (streamer, listener):
                task.cancel()
            await asyncio.gather(streamer, listener, return_exceptions=True)

    async def _stream_quietly(self, send: Send, body_send: Send) -> None:
        try:
            await self._stream(send, body_send)
        except OSError:
            pass  # the client went away mid-write; the generator's finally has cleaned up
        finally:
            await _close(self.body_iterator)

    async def _stream(self, send: Send, body_send: Send) -> None:
        """Starlette's `stream_response` (our chunks are bytes already), body to `body_send`."""
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            await body_send({"type": "http.response.body", "body": chunk, "more_body": True})
        await body_send({"type": "http.response.body", "body": b"", "more_body": False})


class BundleApp(FastAPI):
    """The FastAPI app, keeping the server's own `send` in each request's scope for
    `EventStreamResponse` (nothing else in the app needs or touches it)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[SERVER_SEND_KEY] = send
        await super().__call__(scope, receive, send)


async def _close(iterator: Any) -> None:
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        await aclose()


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
            # reading it to reach the next request (shared/http_limits.py, LingeringClose).
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
        service.count_rejection(status)
