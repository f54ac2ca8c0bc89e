"""A streaming client that survives dropped connections.

It speaks three event-stream dialects, so one client consumes every way this bundle is served:
- OpenAI-compatible SSE (this bundle on Modal or locally, or any other server): `data: {chunk}`
  events ending in `data: [DONE]`. When the server numbers its events (`id:` lines, as this
  bundle does for a request with an `X-Request-Id` and `Accept: text/event-stream`, which this
  client always sends), a
  dropped stream is resumed with the same `X-Request-Id` and `Last-Event-ID`, and each delta
  is yielded exactly once. Servers without ids cannot be resumed; the client
  then says so with `ResumeUnsupported` instead of silently restarting the generation.
  A stream that ends without `[DONE]` is resumed the same way: that is how this bundle's replicas
  hand a stream over when they shut down, and the replica the resume reaches continues it (as it
  does when the first one died: docs/replicas.md, takeover).
- Cog's local server (coglet): events `start`, `output {"chunk", "index"}`, `log`, `completed`.
- Replicate's hosted stream: events `output` (plain text), `error`, `done`.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson

from bundle_client.sse import ServerSentEvent, parse_events

RETRYABLE_STATUS = frozenset({429, 502, 503, 504})


class ClientError(Exception):
    """Base of the client's errors."""


class ServerError(ClientError):
    """The server answered with an error (an OpenAI error JSON, or a failed prediction)."""

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.code = code


class StreamGone(ServerError):
    """The server no longer holds the events needed to resume: the text would have a gap."""


class ResumeUnsupported(ClientError):
    """The stream broke and the server sends no event ids, so it cannot be resumed."""


class RetriesExhausted(ClientError):
    """The stream kept breaking; the last cause is chained."""


class ResumableClient:
    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        max_retries: int = 8,
        backoff_s: float = 0.2,
        max_backoff_s: float = 5.0,
        read_timeout_s: float = 60.0,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        timeout = httpx.Timeout(10.0, read=read_timeout_s)
        self._http = http or httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout)
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.reconnects = 0  # how many times the last stream had to be resumed

    async def __aenter__(self) -> ResumableClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # --- OpenAI-compatible -----------------------------------------------------------------
    async def stream_chat(
        self, messages: list[dict[str, str]], *, request_id: str | None = None, **params: Any
    ) -> AsyncIterator[str]:
        body = {"messages": messages, **params, "stream": True}
        async for chunk in self.stream_chunks("/v1/chat/completions", body, request_id):
            for choice in chunk.get("choices", []):
                text = (choice.get("delta") or {}).get("content")
                if text:
                    yield text

    async def stream_completion(
        self, prompt: str, *, request_id: str | None = None, **params: Any
    ) -> AsyncIterator[str]:
        body = {"prompt": prompt, **params, "stream": True}
        async for chunk in self.stream_chunks("/v1/completions", body, request_id):
            for choice in chunk.get("choices", []):
                if choice.get("text"):
                    yield choice["text"]

    async def stream_chunks(
        self,
        path: str,
        body: dict[str, Any],
        request_id: str | None = None,
        last_event_id: int | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """Yield each chunk once, reconnecting with Last-Event-ID after a broken connection.

        `last_event_id` resumes a stream this process did not start (say, one whose id and
        position were saved before a restart)."""
        request_id = request_id or f"client-{uuid.uuid4().hex}"
        last_id = last_event_id
        yielded = numbered = False
        self.reconnects = 0
        while True:
            headers = {"X-Request-Id": request_id, "Accept": "text/event-stream"}
            if last_id is not None:
                headers["Last-Event-ID"] = str(last_id)
            try:
                async with self._http.stream("POST", path, json=body, headers=headers) as response:
                    await self._check_status(response)
                    async for event in parse_events(response.aiter_lines()):
                        if event.id is not None:
                            numbered, last_id = True, int(event.id)
                        if event.data == "[DONE]":
                            return
                        yielded = True
                        yield _decode_chunk(event)
                raise httpx.RemoteProtocolError("the stream ended without [DONE]")
            except _Retryable as exc:
                await self._backoff(exc)  # same X-Request-Id: the server never runs it twice
            except httpx.TransportError as exc:
                if yielded and not numbered:
                    raise ResumeUnsupported(
                        "the stream broke and the server sends no event ids; cannot resume "
                        "without repeating text"
                    ) from exc
                await self._backoff(exc)

    # --- Cog (local coglet server) and Replicate's hosted stream ---------------------------
    async def stream_prediction(self, inputs: dict[str, Any]) -> AsyncIterator[str]:
        """Stream a local Cog server's prediction (`POST /predictions`) as text pieces."""
        headers = {"Accept": "text/event-stream"}
        async with self._http.stream(
            "POST", "/predictions", json={"input": inputs}, headers=headers
        ) as response:
            await self._check_status(response, retry=False)
            async for piece in _prediction_text(parse_events(response.aiter_lines())):
                yield piece

    async def stream_url(self, url: str) -> AsyncIterator[str]:
        """Stream a Replicate prediction's `urls.stream` (GET, SSE) as text pieces."""
        headers = {"Accept": "text/event-stream", "Cache-Control": "no-store"}
        async with self._http.stream("GET", url, headers=headers) as response:
            await self._check_status(response, retry=False)
            async for piece in _prediction_text(parse_events(response.aiter_lines())):
                yield piece

    # --- helpers ---------------------------------------------------------------------------
    async def _check_status(self, response: httpx.Response, *, retry: bool = True) -> None:
        if response.status_code < 400:
            return
        await response.aread()
        if retry and response.status_code in RETRYABLE_STATUS:
            raise _Retryable(response)
        raise _server_error(response)

    async def _backoff(self, cause: Exception) -> None:
        self.reconnects += 1
        if self.reconnects > self.max_retries:
            raise RetriesExhausted(f"gave up after {self.max_retries} retries: {cause!r}") from cause
        delay = min(self.backoff_s * 2 ** (self.reconnects - 1), self.max_backoff_s)
        if isinstance(cause, _Retryable):
            delay = max(delay, cause.retry_after_s)
        await asyncio.sleep(delay)


class _Retryable(Exception):
    """A status worth retrying with the same X-Request-Id (which makes retries safe)."""

    def __init__(self, response: httpx.Response) -> None:
        super().__init__(f"HTTP {response.status_code}")
        raw = response.headers.get("retry-after", "0")
        self.retry_after_s = float(raw) if raw.replace(".", "", 1).isdigit() else 0.0


def _server_error(response: httpx.Response) -> ServerError:
    try:
        error = response.json().get("error") or {}
    except ValueError:
        error = {}
    message = error.get("message") or response.text or f"HTTP {response.status_code}"
    code = error.get("code")
    kind = StreamGone if response.status_code == 410 or code == "events_gone" else ServerError
    return kind(message, status=response.status_code, code=code)


def _decode_chunk(event: ServerSentEvent) -> dict[str, Any]:
    chunk = orjson.loads(event.data)
    if isinstance(chunk, dict) and "error" in chunk:
        error = chunk["error"] or {}
        code = error.get("code")
        kind = StreamGone if code == "events_gone" else ServerError
        raise kind(error.get("message", "stream failed"), code=code)
    return chunk


async def _prediction_text(events: AsyncIterator[ServerSentEvent]) -> AsyncIterator[str]:
    """Cog (`output {"chunk"}`, `completed`) and Replicate (`output` text, `error`, `done`)."""
    async for event in events:
        if event.event == "output":
            yield _output_piece(event.data)
        elif event.event == "error":
            raise ServerError(f"prediction failed: {event.data}")
        elif event.event in ("done", "completed"):
            _raise_if_failed(event.data)
            return


def _output_piece(data: str) -> str:
    if data.startswith("{"):
        try:
            payload = orjson.loads(data)
        except orjson.JSONDecodeError:
            return data
        if isinstance(payload, dict) and "chunk" in payload:
            return str(payload["chunk"])
    return data


def _raise_if_failed(data: str) -> None:
    try:
        payload = orjson.loads(data) if data else {}
    except orjson.JSONDecodeError:
        return
    if not isinstance(payload, dict):
        return
    status = payload.get("status") or payload.get("reason")
    if status in ("failed", "error"):
        raise ServerError(f"prediction failed: {payload.get('error') or status}")
    if status in ("canceled", "cancelled"):
        raise ServerError("prediction was cancelled", code="cancelled")
