"""What every generation route does with a request, whichever API it speaks (OpenAI's chat and
completions in api.py, the Responses API in responses_api.py): find the service, admit, read the
JSON body under its cap, and stream SSE."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from shared.errors import EngineUnavailable, InvalidRequest, RequestTooLarge, UnsupportedMediaType
from shared.generation.replay import WriteNow
from shared.http.direct_write import Fallback, direct_write
from shared.http.server_internals import init_streaming_response
from shared.service import Service
from shared.settings import Settings

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SERVER_SEND_KEY = "bundle.server_send"  # the server's own ASGI send, in the scope (api.BundleApp)
# A stream's chunks, opened once the connection's direct write (or None) is known.
OpenEvents = Callable[[WriteNow | None], AsyncIterator[bytes]]


def service_of(request: Request) -> Service:
    service: Service | None = getattr(request.app.state, "service", None)
    if service is None:
        raise EngineUnavailable("the engine is starting")
    return service


def check_admission(request: Request) -> None:
    """New generations only while serving with a live engine: 503 before any 200 is sent."""
    service = service_of(request)
    request.app.state.server_state.check_admission()
    if not service.healthy():
        raise EngineUnavailable("the engine is not running")


def check_json_content_type(request: Request) -> None:
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        raise UnsupportedMediaType(
            "send the request body as JSON with 'Content-Type: application/json'", param="Content-Type"
        )


async def read_json(request: Request, settings: Settings) -> Any:
    """Read the body with a hard cap (413) and decode it (400), before any other work."""
    check_json_content_type(request)
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


class EventStreamResponse(StreamingResponse):
    """SSE response that notices a client leaving even while no token is being written.

    Starlette only finds out about a disconnect on its next write under ASGI 2.4; a generation
    still queued or in a long prefill writes nothing, so we also listen for `http.disconnect`.

    Its body chunks (one per token and stream, the hottest path of the server) go to the
    server's own `send` (`BundleApp` keeps it in the scope), past the send wrappers of
    Starlette's and FastAPI's error handling: those only watch for `http.response.start`, which
    still goes through them, and pass every body message on unchanged. Given `OpenEvents`
    instead of the chunks and a `direct_write_fallback` (direct writes on), it opens them with
    that server's direct write (direct_write.py), so that most chunks skip even that `send`;
    each chunk that cannot is counted by its reason.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncIterator[bytes] | OpenEvents,
        headers: Mapping[str, str] | None = None,
        direct_write_fallback: Fallback | None = None,
    ) -> None:
        # Not StreamingResponse's own: the body may only be opened in __call__, where the
        # server's send is known. The rest of what it sets, set as it sets it (server_internals).
        self._events = events
        self._fallback = direct_write_fallback  # None: opened without a direct write
        init_streaming_response(self, headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body_send: Send = scope.get(SERVER_SEND_KEY, send)
        events = self._events
        if callable(events):
            write_now = None if self._fallback is None else direct_write(body_send, self._fallback)
            self.body_iterator = events(write_now)
        else:
            self.body_iterator = events
        streamer = asyncio.create_task(self._stream_quietly(send, body_send))
        listener = asyncio.create_task(_until_disconnect(receive))
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


async def _until_disconnect(receive: Receive) -> None:
    """Return when the server says the client has gone (ASGI's `http.disconnect`)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _close(iterator: Any) -> None:
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        await aclose()
