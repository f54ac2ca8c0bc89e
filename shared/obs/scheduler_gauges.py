"""vLLM's scheduler figures as gauges: KV-cache usage and the engine's own queue.

The engine side (shared/engine/scheduler_stats.py) keeps the latest figures vLLM's scheduler
reported (BUNDLE_SCHEDULER_STATS); these gauges read them at collection time. They are the
signals the Kubernetes stacks scale on: a growing waiting queue, a KV cache near full.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from prometheus_client.metrics_core import GaugeMetricFamily, Metric


class SchedulerFigures(Protocol):
    kv_cache_usage: float  # 0..1: the share of KV-cache blocks in use
    waiting: int
    running: int


class SchedulerGauges:
    def __init__(self, figures: SchedulerFigures) -> None:
        self._figures = figures

    def collect(self) -> Iterable[Metric]:
        figures = self._figures
        return [
            GaugeMetricFamily(
                "bundle_kv_cache_usage_ratio",
                "Share of the engine's KV-cache blocks in use, 0 to 1 (vLLM's scheduler, last step).",
                value=figures.kv_cache_usage,
            ),
            GaugeMetricFamily(
                "bundle_engine_waiting_requests",
                "Requests in the engine's own waiting queue (vLLM's scheduler, last step).",
                value=figures.waiting,
            ),
            GaugeMetricFamily(
                "bundle_engine_scheduled_requests",
                "Requests the engine's scheduler ran in its last step.",
                value=figures.running,
            ),
        ]
