"""The OTLP switch: traces and metrics pushed out of the container, when asked for.

On only when the standard OTEL_EXPORTER_OTLP_ENDPOINT is set (`Settings.otlp_endpoint`); then the
OpenTelemetry SDK is imported and started here, and nowhere else. Unset, `start_telemetry`
returns None before importing anything: no thread, no exporter, no span, and every hook in the
request path finds no current trace (shared/obs/request_traces.py).

Everything about the export is the SDK's, read from the standard variables by the SDK itself:
the endpoint, headers, timeout, compression and certificates (the exporters), the metric export
interval and timeout (OTEL_METRIC_EXPORT_INTERVAL, _TIMEOUT: the periodic reader), the span batch
(OTEL_BSP_*), the sampler (OTEL_TRACES_SAMPLER, _ARG: the tracer provider), OTEL_SERVICE_NAME and
OTEL_RESOURCE_ATTRIBUTES (the resource), OTEL_SDK_DISABLED. The protocol (OTEL_EXPORTER_OTLP_PROTOCOL
or its per-signal twin: `grpc`, the SDK's default, or `http/protobuf`) picks the exporter class
exactly as the SDK's own autoconfiguration picks it, through the function it uses.

Metrics: the periodic reader exports what /metrics shows (shared/obs/otlp_metrics.py), for the
whole server. With several API processes only the first exports, the figures of all of them
added up, as its /metrics shows them: once per server, not N times. Traces: each process its own
requests' spans.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any, Literal

from prometheus_client.metrics_core import Metric as Family

from shared.obs.request_traces import Tracing
from shared.settings import Settings

log = logging.getLogger(__name__)

Signal = Literal["traces", "metrics"]
ENTRY_POINT_GROUPS = {"traces": "opentelemetry_traces_exporter", "metrics": "opentelemetry_metrics_exporter"}
SHUTDOWN_BOUND_MS = 10_000  # the last export of a stopping container: bounded, never a hang


class Telemetry:
    """The running export: `tracing` for the HTTP layer, `aclose` to flush and stop."""

    def __init__(self, tracing: Tracing, tracer_provider: Any, reader: Any) -> None:
        self.tracing = tracing
        self._tracer_provider = tracer_provider
        self._reader = reader

    async def aclose(self) -> None:
        """The last spans and one last metrics export, then stop. In a thread: the reader's last
        collection runs on this loop, which must stay free to run it."""
        await asyncio.to_thread(self._shutdown)

    def _shutdown(self) -> None:
        self._tracer_provider.shutdown()
        self._reader.shutdown(timeout_millis=SHUTDOWN_BOUND_MS)


def start_telemetry(
    settings: Settings, families: Callable[[], list[Family] | None], loop: asyncio.AbstractEventLoop
) -> Telemetry | None:
    """Start exporting, or return None (nothing imported) when no OTLP endpoint is set.
    `families`: what /metrics shows, or None where this process does not speak for the server."""
    if settings.otlp_endpoint is None:
        return None
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from shared.obs.otlp_metrics import Collector
    from shared.obs.otlp_resource import resource_for

    resource = resource_for(settings)
    tracer_provider = TracerProvider(resource=resource)  # the sampler: OTEL_TRACES_SAMPLER
    tracer_provider.add_span_processor(BatchSpanProcessor(exporter_class("traces")()))
    reader = PeriodicExportingMetricReader(exporter_class("metrics")())
    collector = Collector(loop, families, resource)
    # The reader's one seam for where its data comes from, which a MeterProvider fills in with
    # its instruments' collection: here, the bundle's own registry instead (otlp_metrics.py).
    reader._set_collect_callback(lambda _reader, timeout_millis: collector.metrics_data())
    tracer = tracer_provider.get_tracer("vllm-serverless-bundle")
    log.info("telemetry: OTLP traces and metrics to %s (%s)", settings.otlp_endpoint, exporter_name("traces"))
    return Telemetry(Tracing(tracer, settings.exports_engine_traces), tracer_provider, reader)


def exporter_name(signal: Signal) -> str:
    """`otlp_proto_grpc` or `otlp_proto_http`, from the protocol variables, as the SDK's
    autoconfiguration decides it (grpc when none is set; an unknown protocol raises)."""
    from opentelemetry.sdk._configuration import _get_exporter_entry_point

    return str(_get_exporter_entry_point("otlp", signal))


def exporter_class(signal: Signal) -> Any:
    """The exporter the installed packages register under that name (the OTLP exporters' own
    entry points)."""
    name = exporter_name(signal)
    (found,) = entry_points(group=ENTRY_POINT_GROUPS[signal], name=name)
    return found.load()
