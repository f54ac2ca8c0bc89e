"""A real OTLP/HTTP receiver on loopback: what a collector's `otlphttp` receiver does, minus the
pipeline. POST /v1/metrics and /v1/traces bodies (binary protobuf, gzip or not) are decoded with
`opentelemetry-proto`, kept in arrival order, and answered 200 with the empty export response, as
the OTLP/HTTP spec has it; anything else is a 404 or a 400.

The tests use `otlp_receiver()` (tests/otlp_receiver.py); the H200 stage `otlp` (bench/gpu.sh) runs
it as the server's local endpoint, `python -m bench.otlp_sink --port 4318 --out FILE`, and writes
what it received (requests, spans, metric points) when it is stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

ROUTES: dict[str, tuple[Any, Any]] = {  # path -> (request, response) message classes
    "/v1/metrics": (ExportMetricsServiceRequest, ExportMetricsServiceResponse),
    "/v1/traces": (ExportTraceServiceRequest, ExportTraceServiceResponse),
}


@dataclass
class Received:
    """Everything posted so far, decoded, per path."""

    metrics: list[ExportMetricsServiceRequest] = field(default_factory=list)
    traces: list[ExportTraceServiceRequest] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, path: str, message: Any) -> None:
        with self.lock:
            (self.metrics if path == "/v1/metrics" else self.traces).append(message)

    def spans(self) -> list[Any]:
        with self.lock:
            return [
                span
                for request in self.traces
                for resource in request.resource_spans
                for scope in resource.scope_spans
                for span in scope.spans
            ]

    def summary(self) -> dict[str, int]:
        with self.lock:
            points = sum(
                len(getattr(metric, metric.WhichOneof("data")).data_points)
                for request in self.metrics
                for resource in request.resource_metrics
                for scope in resource.scope_metrics
                for metric in scope.metrics
            )
            requests = {"metric_requests": len(self.metrics), "trace_requests": len(self.traces)}
        return {**requests, "metric_points": points, "spans": len(self.spans())}


def _handler(received: Received) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            kinds = ROUTES.get(self.path)
            if kinds is None:
                self.send_error(404)
                return
            body = self.rfile.read(int(self.headers.get("content-length", "0")))
            if self.headers.get("content-encoding") == "gzip":
                body = gzip.decompress(body)
            request_type, response_type = kinds
            try:
                message = request_type.FromString(body)
            except DecodeError:
                self.send_error(400)
                return
            received.add(self.path, message)
            answer = response_type().SerializeToString()
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass  # quiet: the tests read what was received, not the access log

    return Handler


@contextlib.contextmanager
def otlp_receiver(port: int = 0) -> Iterator[tuple[str, Received]]:
    """A receiver on a loopback port (0: a free one): its base URL (what
    OTEL_EXPORTER_OTLP_ENDPOINT takes) and what it received."""
    received = Received()
    server = ThreadingHTTPServer(("127.0.0.1", port), _handler(received))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()
        server.server_close()


def main() -> None:
    parser = argparse.ArgumentParser(description="An OTLP/HTTP receiver on loopback, until SIGTERM.")
    parser.add_argument("--port", type=int, default=4318)
    parser.add_argument("--out", type=Path, required=True, help="JSON summary written at the end")
    args = parser.parse_args()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with otlp_receiver(args.port) as (url, received):
        print(f"OTLP sink at {url}", flush=True)
        stop.wait()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(received.summary(), indent=2) + "\n")


if __name__ == "__main__":
    main()
