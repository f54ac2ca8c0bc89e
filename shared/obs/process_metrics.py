"""/metrics for the whole server when several API processes serve it (BUNDLE_API_PROCESSES > 1).

Each API process keeps its own registry, written as with one process, and publishes a snapshot of it to a
directory the processes share, once a second. A scrape on any process adds up its own live
samples and the others' latest snapshots: counters, histograms and gauges sum (every gauge here
counts something: streams, generations, requests the engine holds), `_created` keeps the
earliest. `bundle_api_processes` says how many processes the figures cover.

Why not prometheus_client's multiprocess mode: the per-token metrics are lock-free collectors of
their own (loop_metrics.py), which it cannot see; it would make every other metric write a
memory-mapped file; gauges read at scrape time (`set_function`) are unsupported there; and it is
switched on for the whole process by PROMETHEUS_MULTIPROC_DIR, which vLLM's own multi-server
mode also sets. A snapshot costs each process one registry collection a second instead, and a
scrape sees the other processes at most that much later.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.samples import Sample

PUBLISH_INTERVAL_S = 1.0
SampleKey = tuple[str, tuple[tuple[str, str], ...]]


@dataclass(frozen=True)
class ProcessBoard:
    """Where the API processes of one server leave their snapshots; `index` is this one's."""

    directory: Path
    index: int

    def publish(self, registry: CollectorRegistry) -> None:
        """This process's samples now, replacing its previous snapshot in one rename."""
        target = self.directory / f"{self.index}.json"
        scratch = target.with_suffix(".tmp")
        scratch.write_bytes(orjson.dumps([_encode(metric) for metric in registry.collect()]))
        os.replace(scratch, target)

    async def publish_every(self, registry: CollectorRegistry, interval_s: float = PUBLISH_INTERVAL_S) -> None:
        while True:
            self.publish(registry)
            await asyncio.sleep(interval_s)

    def others(self) -> list[list[Metric]]:
        """The other processes' latest snapshots (a process that has published none is left out)."""
        found = []
        for path in sorted(self.directory.glob("*.json")):
            if path.stem != str(self.index):
                with contextlib.suppress(OSError, orjson.JSONDecodeError):
                    found.append([_decode(family) for family in orjson.loads(path.read_bytes())])
        return found

    def exposition(self, registry: CollectorRegistry) -> bytes:
        """The whole server's /metrics: this process live, the others as last published."""
        return generate_latest(_Collected(self.families(registry)))  # type: ignore[arg-type]

    def families(self, registry: CollectorRegistry) -> list[Metric]:
        """What /metrics shows as families (also what OTLP exports, shared/obs/otlp_metrics.py)."""
        snapshots = [list(registry.collect()), *self.others()]
        return [*add_up(snapshots), _processes_gauge(len(snapshots))]


def add_up(snapshots: list[list[Metric]]) -> list[Metric]:
    """One family per name, each sample summed over the snapshots (`_created`: the earliest)."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[SampleKey, float]] = {}
    for snapshot in snapshots:
        for metric in snapshot:
            families.setdefault(metric.name, metric)
            summed = values.setdefault(metric.name, {})
            for sample in metric.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                before = summed.get(key)
                summed[key] = sample.value if before is None else _combine(sample.name, before, sample.value)
    return [_with_samples(families[name], summed) for name, summed in values.items()]


def _combine(name: str, before: float, value: float) -> float:
    return min(before, value) if name.endswith("_created") else before + value


def _with_samples(family: Metric, summed: dict[SampleKey, float]) -> Metric:
    metric = Metric(family.name, family.documentation, family.type, family.unit)
    metric.samples = [Sample(name, dict(labels), value, None, None) for (name, labels), value in summed.items()]
    return metric


class _Collected:
    """What generate_latest reads: families already collected."""

    def __init__(self, metrics: list[Metric]) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        yield from self._metrics


def _processes_gauge(processes: int) -> Metric:
    return GaugeMetricFamily(
        "bundle_api_processes",
        "API processes whose figures this scrape adds up (BUNDLE_API_PROCESSES; fewer while "
        "some are still starting).",
        value=processes,
    )


def _encode(metric: Metric) -> dict[str, Any]:
    return {
        "name": metric.name,
        "documentation": metric.documentation,
        "type": metric.type,
        "unit": metric.unit,
        # JSON has no NaN (a failed gauge reading): null stands for it.
        "samples": [[s.name, s.labels, s.value if math.isfinite(s.value) else None] for s in metric.samples],
    }


def _decode(family: dict[str, Any]) -> Metric:
    metric = Metric(family["name"], family["documentation"], family["type"], family["unit"])
    metric.samples = [
        Sample(name, labels, math.nan if value is None else float(value), None, None)
        for name, labels, value in family["samples"]
    ]
    return metric
