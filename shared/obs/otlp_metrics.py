"""/metrics over OTLP: prometheus_client's families, translated into OpenTelemetry metric data.

One source of truth. The instruments stay prometheus_client's (and the lock-free per-token ones
of loop_metrics.py, which no OpenTelemetry instrument could replace at their cost); this module
reads what a /metrics scrape reads and hands it to the SDK's OTLP exporter, so the two can never
disagree and nothing on the request path is written twice. OpenTelemetry instruments beside them
would double every per-token write, and the Python SDK has no bridge of its own (Go's has).

Translation (the reverse of the OTLP -> Prometheus name rules, so the names come back as
/metrics shows them): a counter `bundle_x` (samples `bundle_x_total`) is a cumulative monotonic
Sum named `bundle_x`, which becomes `bundle_x_total` again; a gauge is a Gauge; a histogram a
cumulative Histogram with the same bounds (`_bucket`, `_count`, `_sum` again); a summary a
Histogram without bounds (its `_count` and `_sum`). No unit is set, so no unit suffix is added.
`_created` is each point's start time. A gauge that could not be read (NaN) is left out.

The families are collected on the server's event loop, as a scrape collects them (the gauges read
at collection time read the registry and the engine, which belong to that loop); the periodic
reader's thread waits for them, then exports (the HTTP or gRPC request never runs on the loop).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from prometheus_client.metrics_core import Metric as Family

SCOPE = "vllm-serverless-bundle"
COLLECT_BOUND_S = 5.0  # a loop this late cannot be collected on; that round is skipped, not queued
Labels = tuple[tuple[str, str], ...]


def translate(families: Iterable[Family], now_ns: int, default_start_ns: int) -> list[Any]:
    """SDK `Metric`s for these prometheus_client families (each non-empty one, in order)."""
    out = []
    for family in families:
        metric = _translate_one(family, now_ns, default_start_ns)
        if metric is not None:
            out.append(metric)
    return out


def _translate_one(family: Family, now_ns: int, default_start_ns: int) -> Any:
    from opentelemetry.sdk.metrics.export import AggregationTemporality, Gauge, Metric, Sum

    starts = _Starts(family, default_start_ns)
    if family.type == "counter":
        points = _number_points(family, "_total", starts, now_ns)
        data: Any = Sum(
            data_points=points, aggregation_temporality=AggregationTemporality.CUMULATIVE, is_monotonic=True
        )
    elif family.type == "gauge":
        points = _number_points(family, "", starts, now_ns)
        data = Gauge(data_points=points)
    elif family.type in ("histogram", "summary"):
        data = _histogram(family, starts, now_ns)
        points = data.data_points
    else:  # info, stateset, unknown: none of the bundle's families
        return None
    if not points:
        return None
    return Metric(name=family.name, description=family.documentation, unit="", data=data)


def _key(labels: dict[str, str], drop: str = "") -> Labels:
    return tuple(sorted((name, value) for name, value in labels.items() if name != drop))


class _Starts:
    """Each series' start time: its `_created` sample, else when this process began exporting."""

    def __init__(self, family: Family, default_ns: int) -> None:
        self._default_ns = default_ns
        self._created = {
            _key(sample.labels): int(sample.value * 1e9)
            for sample in family.samples
            if sample.name == family.name + "_created"
        }

    def of(self, key: Labels) -> int:
        return self._created.get(key, self._default_ns)


def _number_points(family: Family, suffix: str, starts: _Starts, now_ns: int) -> list[Any]:
    from opentelemetry.sdk.metrics.export import NumberDataPoint

    points = []
    for sample in family.samples:
        if sample.name != family.name + suffix or not math.isfinite(sample.value):
            continue
        key = _key(sample.labels)
        points.append(
            NumberDataPoint(
                attributes=dict(key),
                start_time_unix_nano=starts.of(key),
                time_unix_nano=now_ns,
                value=sample.value,
            )
        )
    return points


def _histogram(family: Family, starts: _Starts, now_ns: int) -> Any:
    from opentelemetry.sdk.metrics.export import AggregationTemporality, Histogram, HistogramDataPoint

    series: dict[Labels, dict[str, Any]] = defaultdict(lambda: {"buckets": [], "count": 0, "sum": 0.0})
    for sample in family.samples:
        part = sample.name[len(family.name) :]
        if part == "_bucket":
            series[_key(sample.labels, "le")]["buckets"].append((float(sample.labels["le"]), sample.value))
        elif part in ("_count", "_sum"):
            series[_key(sample.labels)][part[1:]] = sample.value
    points = []
    for key, found in series.items():
        bounds, counts = _buckets(found["buckets"], int(found["count"]))
        points.append(
            HistogramDataPoint(
                attributes=dict(key),
                start_time_unix_nano=starts.of(key),
                time_unix_nano=now_ns,
                count=int(found["count"]),
                sum=found["sum"],
                bucket_counts=counts,
                explicit_bounds=bounds,
                min=None,  # type: ignore[arg-type]  # optional in OTLP; Prometheus never had it
                max=None,  # type: ignore[arg-type]
            )
        )
    return Histogram(data_points=points, aggregation_temporality=AggregationTemporality.CUMULATIVE)


def _buckets(cumulative: Sequence[tuple[float, float]], count: int) -> tuple[list[float], list[int]]:
    """Prometheus's cumulative `le` buckets as OTLP's finite bounds and per-bucket counts (the
    last one above every bound). A summary has no buckets: one bucket holding everything."""
    finite = sorted((le, value) for le, value in cumulative if math.isfinite(le))
    counts, below = [], 0
    for _, value in finite:
        counts.append(int(value) - below)
        below = int(value)
    counts.append(count - below)
    return [le for le, _ in finite], counts


class Collector:
    """Collects the families on the server's loop for the exporter thread, and builds the SDK's
    `MetricsData` around them."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, families: Callable[[], list[Family] | None], resource: Any
    ) -> None:
        self._loop = loop
        self._families = families
        self._resource = resource
        self._started_ns = time.time_ns()

    def metrics_data(self) -> Any:
        """What the reader exports now; None when this round cannot be collected (loop gone or late)."""
        from opentelemetry.sdk.metrics.export import MetricsData, ResourceMetrics, ScopeMetrics
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        families = self._collect_on_loop()
        if families is None:
            return None
        metrics = translate(families, time.time_ns(), self._started_ns)
        scope = ScopeMetrics(scope=InstrumentationScope(SCOPE), metrics=metrics, schema_url="")
        return MetricsData(
            resource_metrics=[ResourceMetrics(resource=self._resource, scope_metrics=[scope], schema_url="")]
        )

    def _collect_on_loop(self) -> list[Family] | None:
        if self._loop.is_closed():
            return None

        async def collect() -> list[Family] | None:
            return self._families()

        try:
            return asyncio.run_coroutine_threadsafe(collect(), self._loop).result(COLLECT_BOUND_S)
        except (TimeoutError, RuntimeError):  # a late loop, or one that stopped meanwhile
            return None
