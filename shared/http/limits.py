"""Bounds on what a connection may cost before the app sees a request: uvicorn's HTTP protocols
with head size and time bounds, early refusal of oversized bodies, and a lingering close.

What is bounded where:
- bytes of a request's head (request line + headers) and the time to deliver it (then that of
  a small body after it): here, in the HTTP protocol, while the bytes arrive: 431 / 408, OpenAI
  error JSON, connection closed. uvicorn has neither for httptools (its default parser), which
  buffers a header of any size (64 MiB took 6 s to parse before the auth middleware could answer
  401) and waits forever for a head that trickles in, or for a declared body that never comes.
- header count and total parsed size, and the identity headers' syntax: `shared.http.headers.HeaderGuard`
  (ASGI, so it also holds where another server runs the app, such as Modal's).
- idle keep-alive connections: uvicorn's `timeout_keep_alive`.
- the body: a declared `Content-Length` over `max_body_bytes` is refused here at its head (413,
  httptools); `shared.http.api` also reads every body with that cap (413: chunked bodies, h11, Modal).
  Either way the connection is then closed without reading the rest (`LingeringClose`).
- the drain after SIGTERM: `shared.server_state` (grace) and uvicorn's `timeout_graceful_shutdown`.

The deploy images pin httptools (shared/requirements-deploy.txt), so both bounds hold there.
Without it uvicorn falls back to h11, whose own `max_incomplete_event_size` bounds the head
size; the head timeout needs httptools.

Closing on a client that is still sending would make the kernel answer its next bytes with a
reset, which can destroy our 413 before the client reads it (most clients send the whole body
before they read). So a connection closed while its request body is unread is closed the way
nginx's lingering close does it: the answer is flushed, our side shut for writing, and whatever
the client still sends is dropped unparsed for at most `LINGER_S`, then the connection closes.

What the protocols read of uvicorn's internals they read through shared/http/server_internals.py,
which checks it at start; where a release lacks it, the bound that needs it is off (logged).
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from starlette.types import Scope

from shared.errors import BundleError, HeadersTooLarge, RequestTimeout, RequestTooLarge
from shared.http import server_internals
from shared.http.headers import stamp_arrival
from shared.http.server_internals import PendingRequest
from shared.obs.internals_check import InternalsCheck
from shared.settings import Settings
from shared.streaming import error_data

_REASONS = {408: b"Request Timeout", 413: b"Content Too Large", 431: b"Request Header Fields Too Large"}


def uvicorn_options(settings: Settings, check: InternalsCheck | None = None) -> dict[str, Any]:
    """The uvicorn.Config keyword arguments that bound connections for these settings, with the
    protocols built for what `check` found of uvicorn's internals (default: the start's check)."""
    check = check or server_internals.found()
    options: dict[str, Any] = {
        "h11_max_incomplete_event_size": settings.max_header_bytes,
        # Keep-alive helps SSE clients that resume or send the next request on one connection.
        "timeout_keep_alive": settings.keep_alive_s,
        # Our own drain ends streams at shutdown_grace_s with an error event; uvicorn's bound is
        # the backstop that cuts whatever still hangs a little later.
        "timeout_graceful_shutdown": int(settings.shutdown_grace_s) + 5,
    }
    protocol = bounded_httptools_protocol(
        settings.max_header_bytes, settings.header_timeout_s, settings.max_body_bytes, check
    )
    options["http"] = protocol if protocol is not None else lingering_h11_protocol(check)
    return options


# How long a closed connection still drops what its client sends (see the module's docstring):
# long enough for a client on a slow link to finish sending and read the answer, short enough
# that a client sending for ever holds nothing for long.
LINGER_S = 2.0


class Lingers(Protocol):
    """The protocol side of a lingering close."""

    lingering: bool

    def request_body_unread(self) -> bool: ...


class LingeringClose(asyncio.Transport):
    """The transport uvicorn's protocol is given: the connection's own, each method passed on
    to it, except that `close()` while the request's body is still arriving lingers instead
    (module docstring)."""

    def __init__(
        self, transport: asyncio.Transport, protocol: Lingers, loop: asyncio.AbstractEventLoop
    ) -> None:
        super().__init__()
        self._transport = transport
        self._protocol = protocol
        self._loop = loop
        # Bound once, over the methods below: uvicorn writes each SSE chunk (one per token and
        # stream) through here, and a plain attribute skips one call on that path (the proxy's
        # lookups were 0.6-0.9 % of the API process's samples in the profiles of 256 streams).
        self.write = transport.write  # type: ignore[method-assign]
        self.is_closing = transport.is_closing  # type: ignore[method-assign]

    def close(self) -> None:
        if self._transport.is_closing() or not self._protocol.request_body_unread():
            self._transport.close()
            return
        self._protocol.lingering = True
        if self._transport.can_write_eof():
            self._transport.write_eof()  # the answer is flushed first, then our FIN
        self._transport.resume_reading()  # drop what comes instead of leaving it in the kernel
        self._loop.call_later(LINGER_S, self._transport.close)

    # The rest of asyncio.Transport, as the connection's own.
    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._transport.get_write_buffer_limits()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._transport.write(data)

    def writelines(self, list_of_data: Any) -> None:
        self._transport.writelines(list_of_data)

    def write_eof(self) -> None:
        self._transport.write_eof()

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def abort(self) -> None:
        self._transport.abort()


def lingering_h11_protocol(check: InternalsCheck | None = None) -> type:
    """uvicorn's h11 protocol, closing with `LingeringClose` (h11 is used without httptools)."""
    base = server_internals.h11_protocol_base(check or server_internals.found())

    class LingeringH11Protocol(base):  # type: ignore[misc,valid-type]
        lingering = False

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(LingeringClose(transport, self, asyncio.get_running_loop()))

        def data_received(self, data: bytes) -> None:
            if not self.lingering:
                super().data_received(data)

    return LingeringH11Protocol


def bounded_httptools_protocol(
    max_head_bytes: int,
    head_timeout_s: float,
    max_body_bytes: int = 1 << 20,
    check: InternalsCheck | None = None,
) -> type | None:
    """uvicorn's httptools protocol with a size and a time bound on each request's head, a
    declared body over `max_body_bytes` refused at its head, and `LingeringClose`; None without
    httptools (uvicorn then falls back to h11, bounded by size only)."""
    base = server_internals.httptools_protocol_base(check or server_internals.found())
    if base is None:
        return None

    class BoundedHttpToolsProtocol(base):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._head_open = True  # reading a request line + headers (not a body)
            self._head_bytes = 0
            self._head_timer: asyncio.TimerHandle | None = None
            # A small request's ASGI task waits for its whole body, then starts at once (below).
            self._in_head_callback = False
            self._waiting_for_body: PendingRequest | None = None
            self.lingering = False
            self._oversized = False  # this request's declared body is over max_body_bytes

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._event_loop = asyncio.get_running_loop()
            self._connection = LingeringClose(transport, self, self._event_loop)
            super().connection_made(self._connection)
            self._arm_head_timer()  # a connection that never sends a byte is bounded too

        def data_received(self, data: bytes) -> None:
            if self.lingering:
                return  # closing: what the client still sends is dropped unparsed
            self._feed(data)
            waiting = self._waiting_for_body
            # Body whole (uvicorn's on_message_complete clears more_body). Started after the
            # parser returned: the app never runs inside it.
            if waiting is not None and waiting.body_whole:
                self._waiting_for_body = None
                self._disarm_head_timer()
                self.start_eagerly(waiting)

        def _feed(self, data: bytes) -> None:
            if not self._head_open:
                super().data_received(data)
                return
            room = max_head_bytes - self._head_bytes
            self._head_bytes += len(data)
            if len(data) <= room:
                super().data_received(data)
                return
            # Feed only what the bound allows: if the head is complete within it, the rest is body.
            super().data_received(data[:room])
            if self._head_open and not self._connection.is_closing():
                self._refuse(HeadersTooLarge(f"request line and headers exceed {max_head_bytes} bytes"))
            elif not self._connection.is_closing():
                super().data_received(data[room:])

        # Once refused, the rest of the bytes already handed to the parser are parsed anyway
        # (it cannot be stopped mid-feed without uvicorn answering 400): ignore them.
        def on_message_begin(self) -> None:
            if self.lingering:
                return
            super().on_message_begin()
            # before the loop queues its task: admission counts from here (else from the app's
            # entry, shared/http/headers.py). ASGI allows the extension key in the scope.
            scope = self.request_scope()
            if scope is not None:
                stamp_arrival(scope)
            self._head_open = True
            self._arm_head_timer()

        def on_headers_complete(self) -> None:
            if self.lingering:
                return
            self._head_open = False
            self._disarm_head_timer()
            self._in_head_callback = True
            try:
                super().on_headers_complete()
            finally:
                self._in_head_callback = False
            if self._oversized:
                self._oversized = False
                self._refuse(RequestTooLarge(f"request body exceeds {max_body_bytes} bytes"))

        def on_body(self, body: bytes) -> None:
            if self.lingering:
                return
            super().on_body(body)
            if self._waiting_for_body is not None:
                # uvicorn stops reading once 64 KiB of body are buffered, until the app reads
                # them; this request's app starts only when its body is whole, so nothing would
                # ever resume the read (a 100-250 KB body waited for the 408). Keep reading:
                # what is buffered is bounded by SMALL_BODY_BYTES.
                self.keep_reading()

        def on_message_complete(self) -> None:
            if self.lingering:
                return
            super().on_message_complete()
            # Whatever comes next on this connection is the next request's head.
            self._head_open = True
            self._head_bytes = 0

        def connection_lost(self, exc: Exception | None) -> None:
            self._waiting_for_body = None  # never started: nothing waits on it
            self._disarm_head_timer()
            super().connection_lost(exc)

        def request_ready(self, request: PendingRequest) -> None:
            """uvicorn starts a request's task at its headers, on the loop's queue. Under load
            that queue holds a write for every stream (256 streams: ~10 ms of work) and the task
            waits behind it, then waits again for its body. A small request is started instead
            when its body is complete, eagerly: parsed, validated and handed to the engine in
            the same loop turn that read it, ahead of the queued token writes."""
            if self._in_head_callback and _declared_length(request.scope) > max_body_bytes:
                # Refused as soon as the head callback returns, before any task or route runs
                # (auth included): nothing of the body is read, buffered or parsed.
                self._oversized = True
                return
            if self._in_head_callback and _small_body(request.scope, request.expects_continue, max_body_bytes):
                self._waiting_for_body = request
                self._arm_head_timer()  # a declared body that never comes is bounded too
                return
            self.start_queued(request)

        def _arm_head_timer(self) -> None:
            if self._head_timer is None:
                self._head_timer = self._event_loop.call_later(head_timeout_s, self._head_timed_out)

        def _disarm_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self._connection.is_closing():
                return
            if self._head_open:
                self._refuse(RequestTimeout(f"request headers not received within {head_timeout_s:g} s"))
            elif self._waiting_for_body is not None:
                self._waiting_for_body = None
                self._refuse(RequestTimeout(f"request body not received within {head_timeout_s:g} s"))

        def _refuse(self, error: BundleError) -> None:
            self._connection.write(raw_error_response(error))
            self._connection.close()  # lingers when a body is still on its way (LingeringClose)

    return BoundedHttpToolsProtocol


# Bodies up to this size are waited for before a request's task starts (see request_ready):
# one chat or completion request, a few packets at most.
SMALL_BODY_BYTES = 256 * 1024


def _small_body(scope: Scope, expects_continue: bool, max_body_bytes: int) -> bool:
    """A body that will arrive whole on its own: declared, small, not held back for a 100
    (and not one to be refused for its size: that is answered at once)."""
    if expects_continue:
        return False
    if any(name == b"transfer-encoding" for name, _ in scope["headers"]):
        return False  # chunked: may stream for as long as the client likes
    return _declared_length(scope) <= min(SMALL_BODY_BYTES, max_body_bytes)


def _declared_length(scope: Scope) -> int:
    """The request's Content-Length; 0 when absent or not a number (the parser refuses those)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else 0
    return 0


def raw_error_response(error: BundleError) -> bytes:
    """A complete HTTP/1.1 response carrying the OpenAI error JSON, closing the connection."""
    body = error_data(error)
    reason = _REASONS.get(error.status_code, b"Error")
    return b"".join(
        [
            b"HTTP/1.1 %d %s\r\n" % (error.status_code, reason),
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n",
            body,
        ]
    )
