"""Per request, outermost: the response's status counted, and the request's trace opened.

Pure ASGI middleware. Every HTTP response is counted by status (`bundle_http_responses_total`,
what the 5xx alert reads), including those of the middleware inside it (401, 431). A POST,
when OTLP is on (the service has a `Tracing`), gets a `RequestTrace` (shared/obs/request_traces.py):
a SERVER span from its first byte (the arrival stamp of shared/http/headers.py) to its response's
end, the child of the client's W3C `traceparent`, current for the request's task and every task
it starts. A stream's chunks go to the server's own `send` (shared/http/requests.py), past this
wrapper: only `http.response.start` and whole bodies pass through it.
"""

from __future__ import annotations

import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared.http.headers import ARRIVED_KEY, stamp_arrival
from shared.obs import request_traces
from shared.obs.request_traces import RequestTrace
from shared.service import Service


class RequestTelemetry:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # what the server sends when the app fails before answering

        async def counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        trace = _open_trace(scope)
        token = request_traces.enter(trace)
        try:
            await self.app(scope, receive, counted)
        finally:
            request_traces.leave(token)
            _count(scope, status)
            if trace is not None:
                route = getattr(scope.get("route"), "path", None)
                trace.end(status, route)


def _open_trace(scope: Scope) -> RequestTrace | None:
    """A trace for a POST while OTLP is on; None otherwise (one attribute lookup when off)."""
    if scope["method"] != "POST":
        return None
    telemetry = getattr(_service(scope), "telemetry", None)
    if telemetry is None:
        return None
    stamp_arrival(scope)  # normally stamped already, by the protocol or HeaderGuard
    started_ns = time.time_ns() - int((time.perf_counter() - scope[ARRIVED_KEY]) * 1e9)
    headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}
    return telemetry.tracing.start_request(f"POST {scope['path']}", headers, started_ns)


def _count(scope: Scope, status: int) -> None:
    service = _service(scope)
    if service is not None:
        service.metrics.count_response(status)


def _service(scope: Scope) -> Service | None:
    """The app's service, once its lifespan started it (requests before that are still counted
    nowhere: there is no registry yet)."""
    return getattr(getattr(scope.get("app"), "state", None), "service", None)
