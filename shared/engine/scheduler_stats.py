"""vLLM's scheduler figures, kept for the gauges of shared/obs/scheduler_gauges.py.

vLLM reports its scheduler's state (KV-cache usage, waiting and running requests) to stat
loggers only, once per engine step, and only when stat collection is on. Passing this logger
to `AsyncLLM` turns collection on without vLLM's default loggers (its periodic log line and its
own Prometheus registry): the bundle's /metrics and OTLP carry the figures instead. Asked for
with BUNDLE_SCHEDULER_STATS (or BUNDLE_ENGINE_TRACES, whose spans need the same collection).
`record` runs on the output handler's loop once per step; it keeps three numbers.
"""

from __future__ import annotations

from typing import Any

# The attribute of the `AsyncLLM` that carries its figures to the engine built on it (vllm.py).
SCHEDULER_FIGURES = "bundle_scheduler_figures"


class SchedulerFigures:
    """The last step's figures (`shared.obs.scheduler_gauges.SchedulerFigures`)."""

    def __init__(self) -> None:
        self.kv_cache_usage = 0.0
        self.waiting = 0
        self.running = 0

    def stat_loggers(self) -> list[Any]:
        """The factory list `AsyncLLM.from_engine_args(stat_loggers=...)` takes."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        figures = self

        class FiguresLogger(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                self.engine_index = engine_index

            def record(
                self,
                scheduler_stats: Any,
                iteration_stats: Any,
                mm_cache_stats: Any = None,
                engine_idx: int = 0,
            ) -> None:
                if scheduler_stats is not None:
                    figures.kv_cache_usage = float(scheduler_stats.kv_cache_usage)
                    figures.waiting = int(scheduler_stats.num_waiting_reqs)
                    figures.running = int(scheduler_stats.num_running_reqs)

            def log_engine_initialized(self) -> None:
                pass

        return [FiguresLogger]
