"""Run the simulation for one workload and autoscaler setting, and sum it up per day."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from cost_model.queueing import effective_concurrency
from cost_model.sampling import plan
from cost_model.service import ServiceProfile
from cost_model.simulate import PoolConfig, run_slice, tables
from cost_model.workload import Workload

DEFAULT_BUDGET = 60_000  # simulated requests per evaluation: ~0.3 s here, p99 from >= 600 tail samples
DEFAULT_SEED = 17


@dataclass(frozen=True)
class Latency:
    p50: float
    p95: float
    p99: float


@dataclass(frozen=True)
class PoolDay:
    """One simulated pool, per day. Container-seconds are split by what platforms bill."""

    setup_s: float
    flex_up_s: float
    flex_busy_s: float
    pinned_s: float
    pinned_busy_s: float
    starts: float
    waited_share: float
    queued_share: float
    peak_containers: int
    ttft: Latency
    e2e: Latency
    simulated_requests: int


def _weighted_percentiles(values: np.ndarray, weights: np.ndarray) -> Latency:
    if values.size == 0:
        return Latency(math.nan, math.nan, math.nan)
    order = np.argsort(values, kind="stable")
    cum = np.cumsum(weights[order])
    cum /= cum[-1]
    last = values.size - 1
    picks = [float(values[order][min(int(np.searchsorted(cum, q)), last)]) for q in (0.5, 0.95, 0.99)]
    return Latency(*picks)


def _warm(service: ServiceProfile, w: Workload, cfg: PoolConfig):  # noqa: ANN202 - closure factory
    def warm(rate: float) -> int:
        load = rate * service.request_seconds(1, w.output_tokens, w.prompt_tokens)
        return max(cfg.min_containers, math.ceil(load / cfg.concurrency))

    return warm


@lru_cache(maxsize=512)
def simulate_pool(
    w: Workload,
    service: ServiceProfile,
    cfg: PoolConfig,
    seed: int = DEFAULT_SEED,
    budget: int = DEFAULT_BUDGET,
) -> PoolDay:
    """Simulate `cfg` serving `w`; the same inputs always give the same answer (seeded)."""
    cap = effective_concurrency(service, cfg.concurrency)
    cfg = PoolConfig(cap, cfg.window_s, cfg.min_containers, cfg.max_containers, cfg.cold_start_s)
    ttft, seconds = tables(
        cap,
        lambda k: service.ttft_for(k, w.prompt_tokens),
        lambda k: service.request_seconds(k, w.output_tokens, w.prompt_tokens),
    )
    sums = np.zeros(8)
    ttfts, e2es, weights, peak, count = [], [], [], 0, 0
    for sl in plan(w, budget, seed, _warm(service, w, cfg)):
        tot, t_obs, e_obs = run_slice(sl.arrivals, sl.horizon, cfg, ttft, seconds, sl.warm)
        pinned = cfg.min_containers * sl.horizon
        sums += sl.per_day * np.array(
            [
                tot.setup_s,
                tot.flex_up_s,
                tot.flex_busy_s,
                pinned,
                tot.pinned_busy_s,
                tot.starts,
                tot.waited_start,
                tot.queued,
            ]
        )
        ttfts.append(np.asarray(t_obs))
        e2es.append(np.asarray(e_obs))
        weights.append(np.full(len(t_obs), sl.per_day))
        peak, count = max(peak, tot.peak_containers), count + len(t_obs)
    served = float(sum(wt.sum() for wt in weights)) or 1.0
    wt = np.concatenate(weights)
    setup_s, flex_up_s, flex_busy_s, pinned_s, pinned_busy_s, starts = (float(x) for x in sums[:6])
    return PoolDay(
        setup_s,
        flex_up_s,
        flex_busy_s,
        pinned_s,
        pinned_busy_s,
        starts,
        waited_share=float(sums[6] / served),
        queued_share=float(sums[7] / served),
        peak_containers=max(peak, cfg.min_containers),
        ttft=_weighted_percentiles(np.concatenate(ttfts), wt),
        e2e=_weighted_percentiles(np.concatenate(e2es), wt),
        simulated_requests=count,
    )
