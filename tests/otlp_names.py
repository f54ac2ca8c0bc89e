"""The standard OTLP -> Prometheus metric name translation, for the tests.

What Prometheus's own OTLP receiver, the Collector's Prometheus exporters, Grafana Cloud and
Mimir do by default (the OpenTelemetry specification's "Prometheus and OpenMetrics
Compatibility", `UnderscoreEscapingWithSuffixes` in Prometheus's otlptranslator): characters
outside [a-zA-Z0-9_:] become `_`; the unit, translated (`s` -> seconds, `By` -> bytes, ...),
is appended unless the name already has it; a monotonic Sum gets `_total`; a Gauge of unit `1`
gets `_ratio`; a Histogram becomes `_bucket`, `_count` and `_sum` series, a Summary `_count`,
`_sum` and its quantiles. Debian's Prometheus (2.42) has no OTLP receiver to do it for us.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

UNITS = {
    "d": "days", "h": "hours", "min": "minutes", "s": "seconds", "ms": "milliseconds",
    "us": "microseconds", "ns": "nanoseconds", "By": "bytes", "KiBy": "kibibytes",
    "MiBy": "mebibytes", "GiBy": "gibibytes", "KBy": "kilobytes", "MBy": "megabytes",
    "GBy": "gigabytes", "%": "percent", "Cel": "celsius", "Hz": "hertz", "V": "volts",
    "W": "watts", "A": "amperes", "J": "joules", "m": "meters",
}  # fmt: skip
PER_UNITS = {"s": "second", "m": "minute", "h": "hour", "d": "day", "w": "week", "mo": "month", "y": "year"}


def _unit_tokens(unit: str) -> list[str]:
    if not unit or "{" in unit:  # annotations like {requests} are not units
        return []
    main, _, per = unit.partition("/")
    tokens = [UNITS.get(main, main)] if main and main != "1" else []
    if per:
        tokens.append("per_" + PER_UNITS.get(per, per))
    return tokens


def prometheus_name(metric: Any) -> str:
    """The Prometheus name of one OTLP `Metric` (opentelemetry.proto.metrics.v1)."""
    tokens = [token for token in re.split(r"[^a-zA-Z0-9:]+", metric.name) if token]
    for token in _unit_tokens(metric.unit):
        if token not in tokens:
            tokens.append(token)
    kind = metric.WhichOneof("data")
    if kind == "sum" and metric.sum.is_monotonic:
        tokens = [token for token in tokens if token != "total"] + ["total"]
    if kind == "gauge" and metric.unit == "1":
        tokens = [token for token in tokens if token != "ratio"] + ["ratio"]
    name = "_".join(tokens)
    return "_" + name if name[:1].isdigit() else name


def series_names(metric: Any) -> set[str]:
    """The series names a backend stores for one OTLP metric."""
    name = prometheus_name(metric)
    kind = metric.WhichOneof("data")
    if kind in ("histogram", "exponential_histogram"):
        return {name + "_bucket", name + "_count", name + "_sum"}
    if kind == "summary":
        return {name, name + "_count", name + "_sum"}
    return {name}


def metrics_of(requests: Iterable[Any]) -> list[Any]:
    """Every OTLP `Metric` in these ExportMetricsServiceRequests."""
    return [
        metric
        for request in requests
        for resource in request.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
    ]
