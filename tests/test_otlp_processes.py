"""Several API processes on one engine (BUNDLE_API_PROCESSES=2), OTLP on: the server's metrics are
exported once, by the first process, as the whole server's (what its /metrics shows, added up
over both processes), never once per process; each process exports its own requests' spans."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import wait_until
from tests.otlp_names import metrics_of
from tests.otlp_receiver import Received, otlp_receiver
from tests.procs_helpers import PinnedClients
from tests.real_server import bundle_server
from tests.test_api_processes import GENERATIONS, SERVER, settled

pytestmark = pytest.mark.timeout(900)

ENVIRONMENT = {
    "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
    "OTEL_METRIC_EXPORT_INTERVAL": "500",
    "OTEL_BSP_SCHEDULE_DELAY": "100",
}


def _pids(resources: list[Any]) -> set[str]:
    return {
        item.value.string_value
        for resource in resources
        for item in resource.attributes
        if item.key == "process.pid"
    }


def _exported(received: Received, name: str) -> float | None:
    """The value of a counter or gauge in the latest metrics export (None before any)."""
    with received.lock:
        latest = received.metrics[-1:]
    for metric in metrics_of(latest):
        if metric.name == name:
            data = metric.sum if metric.WhichOneof("data") == "sum" else metric.gauge
            return sum(point.as_double or point.as_int for point in data.data_points)
    return None


def test_metrics_are_exported_once_per_server(tmp_path: Path) -> None:
    with otlp_receiver() as (endpoint, received):
        environment = {**ENVIRONMENT, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint}
        with bundle_server(tmp_path, environment, **SERVER) as server:
            pins = PinnedClients(server.url, 2)
            try:
                for index in (0, 1):
                    body = {"model": "tiny", "prompt": f"process {index}", "max_tokens": 4}
                    assert pins.client(index).post("/v1/completions", json=body).status_code == 200
                whole = settled(pins, GENERATIONS)
            finally:
                pins.close()
            # The export catches up with the whole server's figure (the other process's share
            # arrives through its published snapshot).
            wait_until(lambda: _exported(received, "bundle_engine_generations") == whole, timeout=30)
            assert _exported(received, "bundle_api_processes") == 2
            wait_until(lambda: len(_span_pids(received)) == 2, timeout=30)
        with received.lock:
            exporters = _pids([rm.resource for request in received.metrics for rm in request.resource_metrics])
    assert len(exporters) == 1  # one process exported metrics, all along
    assert exporters < _span_pids(received)  # ... one of the two whose requests were traced


def _span_pids(received: Received) -> set[str]:
    """The processes whose request spans arrived."""
    with received.lock:
        return _pids(
            [
                resource_spans.resource
                for request in received.traces
                for resource_spans in request.resource_spans
                if any(
                    span.name.startswith("POST ")
                    for scope in resource_spans.scope_spans
                    for span in scope.spans
                )
            ]
        )
