"""uvicorn's and Starlette's internals that the bundle relies on, reached from nowhere else.
Each use is checked once at start against the installed release, with a fallback when missing.

What is used, and by whom:
- uvicorn's httptools protocol (shared/http/limits.py): the request's scope when its first byte
  is read (`arrival_stamp`); the hook that starts a request's task, `_start_asgi_task`, with
  the cycle's `more_body`, flow control's `resume_reading` and `expect_100_continue`
  (`request_start`: a small request starts when its body is whole, one over the cap is refused
  at its head); on Python 3.12 the task started eagerly, with the config's `reset_contextvars`,
  the server's task set and `cycle.run_asgi` (`eager_start`); the cycle's `more_body` again
  for a lingering close (`httptools_lingering_close`).
- uvicorn's h11 protocol: its connection's `their_state`, for a lingering close (limits.py).
- the response cycle behind uvicorn's ASGI `send` (`RequestResponseCycle`): its state and its
  transport, for direct writes (shared/http/direct_write.py).
- `uvicorn.Server._captured_signals`, emptied so a drain ends with an exit code (process.py).
- Starlette's `StreamingResponse.__init__`, whose fields are set directly so that a response's
  body can be opened later, in `__call__` (shared/http/requests.py).

`detect()` finds the path of each use on the installed releases, as shared/engine/vllm_features.py
does for vLLM: `expected` where the pinned release has what it reads (tests/test_server_internals.py
fails otherwise), `fallback` where it is missing and the bundle does without it. `found()` is that
check, made once; `run_server` logs it in one line and hands it to the app, whose /metrics shows
it (`bundle_server_features`).
An instance's attributes cannot be seen on its class: a function's `co_names` lists every attribute
name its code reads or sets, so "`__init__` sets `cycle`" is read there.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Any, cast

from starlette.responses import Response, StreamingResponse
from starlette.types import Scope, Send

from shared.obs.internals_check import Found, InternalsCheck, log_check

log = logging.getLogger(__name__)

HTTPTOOLS_IMPL = "uvicorn.protocols.http.httptools_impl"
H11_IMPL = "uvicorn.protocols.http.h11_impl"
CYCLE_CLASS = "RequestResponseCycle"
# What StreamingResponse.__init__ (Starlette 1.x) reads and sets: anything else there is a field
# the direct setting below would miss, so the public constructor is used instead.
STREAMING_INIT_NAMES = frozenset(
    {"isinstance", "AsyncIterable", "body_iterator", "iterate_in_threadpool", "status_code"}
    | {"media_type", "background", "init_headers"}
)


# --- the check --------------------------------------------------------------------------------------
def _uses(function: object, *names: str) -> bool:
    """Whether `function`'s own code reads or sets every one of `names` (False for no Python code)."""
    code = getattr(function, "__code__", None)
    return code is not None and set(names) <= set(code.co_names)


def _httptools_module() -> Any | None:
    try:
        import uvicorn.protocols.http.httptools_impl as module
    except ImportError:  # no httptools: uvicorn serves with h11
        return None
    return module


def _uvicorn(feature: str, found: bool, path: str, fallback: str) -> Found:
    """`path` where the release has what it needs, else `fallback`."""
    if found:
        return Found("uvicorn", feature, path, "expected")
    return Found("uvicorn", feature, fallback, "fallback")


def httptools_protocol() -> Found:
    found = _httptools_module() is not None
    return _uvicorn("httptools_protocol", found, "httptools_impl", "h11_without_head_timeout")


def arrival_stamp() -> Found:
    """Where a request's admission time starts: the protocol's scope at its first byte."""
    module = _httptools_module()
    found = module is not None and _uses(module.HttpToolsProtocol.on_message_begin, "scope")
    return _uvicorn("arrival_stamp", found, "first_byte", "app_entry")


def request_start() -> Found:
    """A small request's task started when its body is whole, one over the cap refused at its
    head; or uvicorn's own start at the head (a body over the cap is then refused by the app)."""
    module = _httptools_module()
    if module is None:
        return _uvicorn("request_start", False, "when_body_whole", "at_head")
    protocol, cycle = module.HttpToolsProtocol, getattr(module, CYCLE_CLASS, None)
    hook = getattr(protocol, "_start_asgi_task", None)
    found = (
        hook is not None
        and tuple(inspect.signature(hook).parameters) == ("self", "cycle", "app")
        and _uses(protocol.__init__, "cycle", "expect_100_continue")
        and _uses(protocol.connection_made, "flow")
        and callable(getattr(module.FlowControl, "resume_reading", None))
        and cycle is not None
        and _uses(cycle.__init__, "scope", "more_body")
    )
    return _uvicorn("request_start", found, "when_body_whole", "at_head")


def eager_start() -> Found:
    """On Python 3.12 a small request's task runs its first step at once (an eager task)."""
    if sys.version_info < (3, 12):
        return Found("uvicorn", "eager_start", "queued_before_python_3_12", "platform")
    module = _httptools_module()
    from uvicorn.config import Config

    found = (
        module is not None
        and _uses(Config.__init__, "reset_contextvars")
        and _uses(module.HttpToolsProtocol.__init__, "loop", "tasks")
        and callable(getattr(getattr(module, CYCLE_CLASS, None), "run_asgi", None))
    )
    return _uvicorn("eager_start", found, "eager_task", "queued")


def httptools_lingering_close() -> Found:
    cycle = getattr(_httptools_module(), CYCLE_CLASS, None)
    found = cycle is not None and _uses(cycle.__init__, "more_body")
    return _uvicorn("httptools_lingering_close", found, "cycle_more_body", "plain_close")


def h11_lingering_close() -> Found:
    from uvicorn.protocols.http.h11_impl import H11Protocol

    found = _uses(H11Protocol.__init__, "conn")
    return _uvicorn("h11_lingering_close", found, "conn_their_state", "plain_close")


def direct_write() -> Found:
    """Chunks written on the connection from the producer's turn, or every one through `send`."""
    module = _httptools_module()
    cycle = getattr(module, CYCLE_CLASS, None)
    found = (
        module is not None
        and cycle is not None
        and inspect.isfunction(getattr(cycle, "send", None))  # its bound method names the cycle
        and _uses(cycle.__init__, "transport", "flow", "disconnected", "response_started")
        and _uses(cycle.__init__, "response_complete", "chunked_encoding")
        and _uses(module.FlowControl.__init__, "write_paused")
    )
    return _uvicorn("direct_write", found, "httptools_cycle", "send_only")


def signal_exit() -> Found:
    """After a drain for a signal: an exit code (the captured signal forgotten), or death by it."""
    from uvicorn import Server

    found = _uses(Server.__init__, "_captured_signals") and hasattr(Server, "capture_signals")
    return _uvicorn("signal_exit", found, "exit_code", "signal_raised_again")


def response_init() -> Found:
    """An SSE response's fields set as StreamingResponse's constructor sets them, or the
    constructor itself with an empty body that the response replaces when called."""
    found = set(StreamingResponse.__init__.__code__.co_names) <= STREAMING_INIT_NAMES and _uses(
        getattr(Response, "init_headers", None), "raw_headers"
    )
    if found:
        return Found("starlette", "response_init", "fields_set_directly", "expected")
    return Found("starlette", "response_init", "constructor", "fallback")


def detect() -> InternalsCheck:
    """Every use, on the installed uvicorn and Starlette."""
    found = (
        httptools_protocol(),
        arrival_stamp(),
        request_start(),
        eager_start(),
        httptools_lingering_close(),
        h11_lingering_close(),
        direct_write(),
        signal_exit(),
        response_init(),
    )
    return InternalsCheck((_release("uvicorn"), _release("starlette")), found)


def _release(name: str) -> str:
    return f"{name} {metadata.version(name)}"


@functools.cache
def found() -> InternalsCheck:
    """The check, made once (at start: `run_server`); what the code below goes by."""
    return detect()


def log_found(check: InternalsCheck) -> None:
    log_check(log, "server internals", check)


# --- uvicorn's protocols ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PendingRequest:
    """A request whose head uvicorn has parsed and whose task it would start now."""

    cycle: Any
    app: Any
    expects_continue: bool

    @property
    def scope(self) -> Scope:
        return self.cycle.scope  # type: ignore[no-any-return]

    @property
    def body_whole(self) -> bool:
        return not self.cycle.more_body


def httptools_protocol_base(check: InternalsCheck) -> type[Any] | None:
    """uvicorn's httptools protocol, what a subclass needs of its internals as named methods;
    None without httptools. `request_ready` is called for each request only where the check
    found uvicorn's hook (`request_start`); elsewhere uvicorn starts every task itself."""
    if check.path("httptools_protocol") != "httptools_impl":
        return None
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    stamps = check.path("arrival_stamp") == "first_byte"
    lingers = check.path("httptools_lingering_close") == "cycle_more_body"
    eager = check.path("eager_start") == "eager_task"

    class HttpToolsSeam(HttpToolsProtocol):  # type: ignore[misc]
        def request_scope(self) -> Scope | None:
            """The scope of the request whose head is being read (None: not known here)."""
            return cast("Scope", self.scope) if stamps else None

        def request_body_unread(self) -> bool:
            return lingers and self.cycle is not None and bool(self.cycle.more_body)

        def keep_reading(self) -> None:
            self.flow.resume_reading()

        def request_ready(self, request: PendingRequest) -> None:
            """The request's head is parsed: start its task now (a subclass may hold it)."""
            self.start_queued(request)

        def start_queued(self, request: PendingRequest) -> None:
            HttpToolsProtocol._start_asgi_task(self, request.cycle, request.app)

        def start_eagerly(self, request: PendingRequest) -> None:
            if not eager:
                self.start_queued(request)
                return
            context = contextvars.Context() if self.config.reset_contextvars else None
            run = request.cycle.run_asgi(request.app)
            task = asyncio.Task(run, loop=self.loop, eager_start=True, context=context)  # type: ignore[call-arg]
            task.add_done_callback(self.tasks.discard)
            self.tasks.add(task)

    if check.path("request_start") == "when_body_whole":

        def _start_asgi_task(self: HttpToolsSeam, cycle: Any, app: Any) -> None:
            self.request_ready(PendingRequest(cycle, app, self.expect_100_continue))

        HttpToolsSeam._start_asgi_task = _start_asgi_task  # type: ignore[method-assign,assignment]
    return HttpToolsSeam


def h11_protocol_base(check: InternalsCheck) -> type[Any]:
    """uvicorn's h11 protocol, whether the request's body is still arriving as a method."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    lingers = check.path("h11_lingering_close") == "conn_their_state"

    class H11Seam(H11Protocol):  # type: ignore[misc]
        def request_body_unread(self) -> bool:
            return lingers and self.conn.their_state is h11.SEND_BODY

    return H11Seam


# --- the response cycle behind `send` (direct writes) -----------------------------------------------
def response_cycle(send: Send) -> Any | None:
    """uvicorn's httptools response cycle behind `send` (the server's own ASGI send, not a
    middleware's wrapper), or None: another server, or a uvicorn without what a write reads.
    Told apart by name, so that nothing is imported from a protocol this server may not run."""
    cycle = getattr(send, "__self__", None)
    kind = type(cycle)
    if (kind.__module__, kind.__name__) != (HTTPTOOLS_IMPL, CYCLE_CLASS):
        return None
    return cycle if found().path("direct_write") == "httptools_cycle" else None


def cycle_transport(cycle: Any) -> asyncio.Transport:
    return cycle.transport  # type: ignore[no-any-return]


def unwritable(cycle: Any) -> str | None:
    """Why this response's chunk cannot go on its connection now; None when it can."""
    if cycle.disconnected:
        return "disconnected"
    if cycle.flow.write_paused:
        return "paused"
    if not cycle.response_started:
        return "not_started"
    if cycle.response_complete:
        return "complete"
    if not cycle.chunked_encoding:
        return "not_chunked"
    return None


# --- uvicorn's server --------------------------------------------------------------------------------
def forget_captured_signals(server: Any) -> None:
    """uvicorn raises each signal it captured again once its server ends, with the default
    handler back: the signal taken for a drain would kill the process. Forgotten, it does not."""
    if found().path("signal_exit") == "exit_code":
        server._captured_signals.clear()


# --- Starlette's responses ----------------------------------------------------------------------------
def init_streaming_response(response: StreamingResponse, headers: Mapping[str, str] | None) -> None:
    """What StreamingResponse's constructor sets, but the body, which `response.__call__` opens
    (where the server's send is known)."""
    if found().path("response_init") == "fields_set_directly":
        response.status_code = 200
        response.background = None
        response.init_headers(headers)
    else:
        StreamingResponse.__init__(response, (), headers=headers)

