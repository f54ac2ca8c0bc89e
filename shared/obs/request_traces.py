"""One trace per request: its spans, and the events of request identity on it.

The HTTP layer opens a `RequestTrace` per POST (shared/http/telemetry.py) as the child of the
client's W3C `traceparent`, if it sent one, and makes it the current one for the request's task
and every task started from it (a context variable, as OpenTelemetry keeps its own current
span). The core then reports what happens with one call per event, each a no-op when nothing is
traced (telemetry off, or a caller that is not HTTP):

    request span  "POST /v1/chat/completions"   (SERVER; attributes: request id, model, adapter,
    |                                            token counts, status; events: attach, resume,
    |                                            replay, cancel, takeover)
    +- admission          first byte read -> the generation admitted (parsing, identity, checks)
    +- queue wait         admitted -> the engine has the request (the loop, the tokenizer thread,
    |                     a sleeping engine)
    +- time to first token  the engine has it -> its first output (its queue and the prefill)
    +- decode             first output -> last (token counts, finish reason)
    +- stream end         last output -> the response's last byte sent to this client

The spans are written when their end is known, with the times they covered: nothing is held
open across awaits, and nothing is done per token. A client that resumes or attaches with the
same `traceparent` lands in the same trace (its own request span, with a `resume` or `attach`
event); vLLM's own `llm_request` span joins it too with BUNDLE_ENGINE_TRACES (the request's
context is handed to the engine as trace headers). No prompt or output text is recorded.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from contextvars import ContextVar, Token
from typing import Any

_CURRENT: ContextVar[RequestTrace | None] = ContextVar("bundle_request_trace", default=None)


class Tracing:
    """What the HTTP layer needs to open request traces: the tracer, the W3C propagator, and
    whether the engine gets the context too (vLLM's own tracing on)."""

    def __init__(self, tracer: Any, engine_headers: bool) -> None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._tracer = tracer
        self._propagator = TraceContextTextMapPropagator()
        self._engine_headers = engine_headers

    def start_request(self, name: str, headers: Mapping[str, str], started_ns: int) -> RequestTrace:
        from opentelemetry.trace import SpanKind

        parent = self._propagator.extract(headers)  # an empty context without a valid traceparent
        span = self._tracer.start_span(name, context=parent, kind=SpanKind.SERVER, start_time=started_ns)
        return RequestTrace(self, span, started_ns)

    def child(self, parent: Any, name: str, start_ns: int, end_ns: int, attributes: Mapping[str, Any]) -> Any:
        """A span of `parent`'s that already happened, written at once."""
        from opentelemetry.trace import set_span_in_context

        span = self._tracer.start_span(
            name, context=set_span_in_context(parent), start_time=start_ns, attributes=dict(attributes)
        )
        span.end(end_time=end_ns)
        return span

    def headers_of(self, span: Any) -> dict[str, str] | None:
        """`span`'s W3C headers for the engine, where vLLM's tracing is on (else None: vLLM warns
        about every request that carries trace headers while its tracing is off)."""
        if not self._engine_headers:
            return None
        from opentelemetry.trace import set_span_in_context

        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=set_span_in_context(span))
        return carrier


class RequestTrace:
    """One request's span and the generation it started (if it started one)."""

    def __init__(self, tracing: Tracing, span: Any, started_ns: int) -> None:
        self.tracing = tracing
        self.span = span
        self.started_ns = started_ns
        self.generation: GenerationTrace | None = None

    def admitted(self) -> None:
        self.tracing.child(self.span, "admission", self.started_ns, time.time_ns(), {})

    def event(self, name: str, attributes: Mapping[str, Any]) -> None:
        self.span.add_event(name, attributes=dict(attributes))

    def start_generation(self) -> GenerationTrace:
        self.generation = GenerationTrace(self)
        return self.generation

    def end(self, status: int, route: str | None) -> None:
        """The response's last byte is out (or the request failed): the stream end and the span."""
        from opentelemetry.trace import Status, StatusCode

        now = time.time_ns()
        finished = self.generation.finished_ns if self.generation is not None else None
        if finished is not None:
            self.tracing.child(self.span, "stream end", finished, now, {})
        if route is not None:
            self.span.update_name(f"POST {route}")
        self.span.set_attribute("http.response.status_code", status)
        if status >= 500:
            self.span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
        self.span.end(end_time=now)


class GenerationTrace:
    """The spans of one generation, under the request that started it or took it over."""

    def __init__(self, request: RequestTrace) -> None:
        self._request = request
        self._admitted_ns = time.time_ns()
        self._engine_ns: int | None = None
        self._first_ns: int | None = None
        self.finished_ns: int | None = None

    def engine_headers(self) -> dict[str, str] | None:
        return self._request.tracing.headers_of(self._request.span)

    def engine_started(self) -> None:
        now = time.time_ns()
        self._engine_ns = now
        self._request.tracing.child(self._request.span, "queue wait", self._admitted_ns, now, {})

    def first_token(self) -> None:
        now = time.time_ns()
        self._first_ns = now
        started = self._engine_ns if self._engine_ns is not None else self._admitted_ns
        self._request.tracing.child(self._request.span, "time to first token", started, now, {})

    def finished(self, prompt_tokens: int, completion_tokens: int, outcome: str) -> None:
        """Its last output: the decode span (when a first token came) and the token counts."""
        now = time.time_ns()
        self.finished_ns = now
        usage = {
            "gen_ai.usage.input_tokens": prompt_tokens,
            "gen_ai.usage.output_tokens": completion_tokens,
            "bundle.outcome": outcome,
        }
        if self._first_ns is not None:
            self._request.tracing.child(self._request.span, "decode", self._first_ns, now, usage)
        self._request.span.set_attributes(usage)


# --- the calls the core makes (each a no-op without a current trace) -----------------------------
def current() -> RequestTrace | None:
    return _CURRENT.get()


def enter(trace: RequestTrace | None) -> Token[RequestTrace | None]:
    return _CURRENT.set(trace)


def leave(token: Token[RequestTrace | None]) -> None:
    _CURRENT.reset(token)


def note_request(request_id: str | None, model: str, adapter: bool) -> None:
    """What the request asks for: its id (X-Request-Id), the model it names, and whether that
    is a LoRA adapter (then also `bundle.adapter`)."""
    trace = _CURRENT.get()
    if trace is not None:
        attributes: dict[str, Any] = {"gen_ai.request.model": model}
        if adapter:
            attributes["bundle.adapter"] = model
        if request_id is not None:
            attributes["bundle.request_id"] = request_id
        trace.span.set_attributes(attributes)


def note_admitted() -> None:
    trace = _CURRENT.get()
    if trace is not None:
        trace.admitted()


def note_event(name: str, **attributes: Any) -> None:
    """attach, resume, replay (an existing generation), cancel, takeover: an event on the span."""
    trace = _CURRENT.get()
    if trace is not None:
        trace.event(name, attributes)


def generation_trace() -> GenerationTrace | None:
    """The spans of a generation this request starts (None when nothing is traced)."""
    trace = _CURRENT.get()
    return None if trace is None else trace.start_generation()


def takeover_trace(request_id: str, outcome: str, kept: int) -> GenerationTrace | None:
    """A generation another replica started, taken over for this request: an event, and the
    spans of the rest it runs here."""
    trace = _CURRENT.get()
    if trace is None:
        return None
    trace.event(
        "takeover", {"bundle.request_id": request_id, "bundle.outcome": outcome, "bundle.kept_tokens": kept}
    )
    return trace.start_generation()
