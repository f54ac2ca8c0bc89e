"""Request headers the bundle reads, parsed so that any byte sequence gives a value or a 4xx.

Starlette hands header values over as latin-1 text, so `str.isdigit()` alone lets through
characters `int()` refuses (a superscript two is a digit to Python) and any length at all;
everything here checks bytes against ASCII first and bounds lengths before converting.

`HeaderGuard` applies the same rules to every request before any route (and before auth):
header count and size, and the syntax of the identity headers, so that no handler ever sees
an X-Request-Id it would hold for minutes or echo back unbounded.
"""

from __future__ import annotations

import hmac
import time

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from shared.errors import BundleError, HeadersTooLarge, InvalidRequest
from shared.schemas import REQUEST_ID_MAX_LENGTH

# 18 digits hold any event count a stream can reach (and stay below 2**63); a longer value is
# not an id this server ever sent.
LAST_EVENT_ID_MAX_DIGITS = 18
# Headers a request may carry once: two different values would make "which one counts" depend on
# the layer asked (a proxy may pick the last, Starlette picks the first).
SINGLE_HEADERS = (b"x-request-id", b"last-event-id", b"authorization", b"content-type")
# When this server first saw the request (time.perf_counter), in its ASGI scope: stamped by the
# bounded HTTP protocol as the request's first byte is parsed (shared/http/limits.py), else by
# HeaderGuard when the request's task first runs. What happens between that and the engine
# having the request (the event loop's queue, parsing, validation) is the server's admission time.
ARRIVED_KEY = "bundle.arrived_s"


def stamp_arrival(scope: Scope) -> None:
    scope.setdefault(ARRIVED_KEY, time.perf_counter())


def admission_seconds(scope: Scope) -> float:
    return time.perf_counter() - scope[ARRIVED_KEY]


def parse_request_id(raw: str | None, *, param: str = "X-Request-Id") -> str | None:
    """A client's request id: 1..256 printable ASCII characters, or None when absent/empty."""
    if raw is None or raw == "":
        return None
    if len(raw) > REQUEST_ID_MAX_LENGTH:
        raise InvalidRequest(f"{param} is longer than {REQUEST_ID_MAX_LENGTH} characters", param=param)
    if not (raw.isascii() and raw.isprintable()) or raw != raw.strip():
        raise InvalidRequest(
            f"{param} must be printable ASCII without surrounding spaces", param=param, code="invalid_value"
        )
    return raw


def parse_last_event_id(raw: str | None) -> int | None:
    """The SSE resume point: ASCII digits, at most 18 of them, or None when absent/empty."""
    if raw is None or raw == "":
        return None
    if not (raw.isascii() and raw.isdigit()) or len(raw) > LAST_EVENT_ID_MAX_DIGITS:
        raise InvalidRequest(
            f"Last-Event-ID must be a non-negative integer of at most {LAST_EVENT_ID_MAX_DIGITS} digits",
            param="Last-Event-ID",
        )
    return int(raw)


def accepts_event_stream(raw: str | None) -> bool:
    """Whether an Accept header names `text/event-stream` itself: a comma-separated list of media
    ranges, compared without case, parameters (q included) ignored. Wildcards (`*/*`, `text/*`)
    do not count: a client that names no SSE type may read one `data:` line per event (OpenAI's
    framing), and an `id:` line would break it."""
    if not raw:
        return False
    return any(part.partition(";")[0].strip().lower() == "text/event-stream" for part in raw.split(","))


def bearer_token_matches(value: bytes, api_key: bytes) -> bool:
    """`Authorization: Bearer <key>`, the scheme in any case (RFC 9110 makes it case-insensitive),
    the key compared in constant time."""
    scheme, _, token = value.partition(b" ")
    if scheme.lower() != b"bearer":
        return False
    return hmac.compare_digest(token.strip(b" \t"), api_key)


class HeaderGuard:
    """Pure ASGI middleware, outermost: bounds the parsed headers and checks the identity headers'
    syntax on every route, answering OpenAI error JSON (431/400) before auth or any handler."""

    def __init__(self, app: ASGIApp, max_count: int, max_bytes: int) -> None:
        self.app = app
        self.max_count = max_count
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            stamp_arrival(scope)
            try:
                self.check(scope["headers"])
            except BundleError as error:
                await JSONResponse(error.to_openai(), status_code=error.status_code)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def check(self, headers: list[tuple[bytes, bytes]]) -> None:
        if len(headers) > self.max_count:
            raise HeadersTooLarge(f"a request may carry at most {self.max_count} headers")
        if sum(len(name) + len(value) for name, value in headers) > self.max_bytes:
            raise HeadersTooLarge(f"request headers exceed {self.max_bytes} bytes")
        seen: dict[bytes, bytes] = {}
        for name, value in headers:
            if name in SINGLE_HEADERS:
                if name in seen and seen[name] != value:
                    raise InvalidRequest(f"header {name.decode()} given twice with different values")
                seen[name] = value
        parse_request_id(_latin1(seen.get(b"x-request-id")))
        parse_last_event_id(_latin1(seen.get(b"last-event-id")))


def _latin1(value: bytes | None) -> str | None:
    # The decoding Starlette applies, so the guard judges exactly what the handlers will read.
    return None if value is None else value.decode("latin-1")
