"""Without OTEL_EXPORTER_OTLP_ENDPOINT the export costs nothing: the whole HTTP app serves a
traced POST (a client traceparent and all) and the OpenTelemetry parts the export would use
(the trace SDK, the OTLP exporters, the W3C propagator) are never imported, and no thread is
started. With the variable set, the same run imports them and starts the SDK's threads (so the
check can fail), and the receiver gets the request's spans.

(redis-py 8 imports `opentelemetry.sdk.metrics` itself when the SDK is installed, at `import
redis`, whatever the bundle does: that is why the check names the export's own modules.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import wait_until
from tests.otlp_receiver import otlp_receiver

ROOT = Path(__file__).resolve().parents[1]
EXPORT_MODULES = (
    "opentelemetry.sdk.trace",
    "opentelemetry.exporter",
    "opentelemetry.trace.propagation.tracecontext",
)


def probe(**environment: str) -> dict[str, Any]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("OTEL_")}
    done = subprocess.run(
        [sys.executable, "-m", "tests.telemetry_probe"],
        cwd=ROOT,
        env={**env, **environment},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def export_modules(found: dict[str, Any]) -> list[str]:
    return [name for name in found["modules"] if name.startswith(EXPORT_MODULES)]


@pytest.mark.slow
def test_off_imports_and_starts_nothing() -> None:
    found = probe()
    assert found["status"] == 200
    assert export_modules(found) == []
    assert found["threads"] == ["MainThread"]


@pytest.mark.slow
def test_on_imports_the_sdk_and_exports_the_request() -> None:
    with otlp_receiver() as (endpoint, received):
        found = probe(OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf")
        assert found["status"] == 200
        assert "opentelemetry.sdk.trace" in export_modules(found)
        assert len(found["threads"]) > 1  # the span batcher's and the metric reader's
        wait_until(lambda: any(span.name == "decode" for span in received.spans()), timeout=30)
    spans = received.spans()
    assert {span.trace_id.hex() for span in spans} == {"0af7651916cd43dd8448eb211c80319c"}
