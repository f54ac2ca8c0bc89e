"""Analytic replica model: how many container-seconds a traffic segment keeps billed.

Requests in flight N follow the M/G/infinity law (Poisson with mean L = rate x request time).
Replicas are filled in order, each taking up to C streams, so replica j is busy while
N > (j-1)C. For replica j we know, in closed form:

* busy fraction            p_j = P(N > (j-1)C)
* busy periods per second  b_j = rate x P(N = (j-1)C)   (an arrival lifts N over the threshold)
* idle gaps                exponential with rate r_j = b_j / P(N <= (j-1)C); for j=1, r_1 = rate
* idle billed per gap      E[min(gap, W)] = (1 - e^{-r W}) / r
* cold starts per second   b_j x e^{-r W}             (the gap outlived the scale-down window)

Start-up time stretches each replica's cycle, so every per-replica figure is divided by
(1 + cold x setup). For replica 1 this reproduces the exact renewal-cycle result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cost_model.service import ServiceProfile

SIGMAS = 10.0  # Poisson mass further than this many std devs from the mean is ignored


@dataclass(frozen=True)
class Rules:
    """Billing and autoscaling rules in force for one evaluation."""

    bills_setup: bool
    bills_idle: bool
    window_s: float
    min_containers: int
    concurrency: int
    cold_start_s: float


@dataclass(frozen=True)
class PoolStats:
    billed: float  # replica-seconds billed per wall-clock second
    busy: float  # replica-seconds with at least one request in flight, per second
    cold_per_s: float  # cold starts per second
    replicas: int  # replicas needed at this rate (Little's law)
    sharing: float  # mean streams sharing a busy replica
    request_s: float  # wall time of one request at that sharing


def effective_concurrency(service: ServiceProfile, concurrency: int) -> int:
    # Concurrency above the highest benchmarked level is not credited (see ServiceProfile).
    cap = service.max_measured_concurrency
    return max(1, int(min(float(concurrency), cap)))


def _occupancy(load: float, poisson: bool) -> float:
    """Mean number of requests in flight while at least one is (M/G/inf, or deterministic)."""
    if not poisson:
        return max(1.0, load)
    if load < 1e-9:
        return 1.0
    return load / -math.expm1(-load)


def sharing(
    rate: float, service: ServiceProfile, output_tokens: int, cap: int, poisson: bool, prompt_tokens: int = 0
) -> tuple[float, float]:
    """Solve k = min(cap, occupancy(rate x S(k))): streams slow each other down, which raises load.

    Each step is monotone in k, so iterating from k = 1 climbs to the smallest fixed point.
    """
    k = 1.0
    seconds = service.request_seconds(k, output_tokens, prompt_tokens)
    for _ in range(60):
        nxt = min(float(cap), _occupancy(rate * seconds, poisson))
        if abs(nxt - k) < 1e-10:
            break
        k = nxt
        seconds = service.request_seconds(k, output_tokens, prompt_tokens)
    return k, seconds


def replicas_needed(load: float, cap: int) -> int:
    return max(1, math.ceil(load / cap - 1e-12)) if load > 0 else 0


def _poisson_table(load: float, lo: int, hi: int) -> tuple[list[float], list[float]]:
    log_load = math.log(load)
    pmf = [math.exp(i * log_load - load - math.lgamma(i + 1)) for i in range(lo, hi + 1)]
    cdf, acc = [], 0.0
    for p in pmf:
        acc += p
        cdf.append(min(acc, 1.0))
    return pmf, cdf


def _replica_share(
    rate: float, p: float, pmf_t: float, cdf_t: float, rules: Rules
) -> tuple[float, float, float]:
    """(billed, busy, cold starts) per second for one scale-to-zero replica."""
    begins = rate * pmf_t
    gap_rate = begins / cdf_t if cdf_t > 0 else rate
    if gap_rate > 0:
        idle = begins * -math.expm1(-gap_rate * rules.window_s) / gap_rate
        cold = begins * math.exp(-gap_rate * rules.window_s)
    else:
        idle, cold = begins * rules.window_s, begins
    stretch = 1.0 + cold * rules.cold_start_s
    setup = cold * rules.cold_start_s if rules.bills_setup else 0.0
    if not rules.bills_idle:
        # Active-only billing charges each request's own time, which start-ups do not shrink.
        return p + setup / stretch, p, cold / stretch
    return (p + idle + setup) / stretch, p / stretch, cold / stretch


def poisson_pool(rate: float, seconds: float, k: float, cap: int, rules: Rules) -> PoolStats:
    load = rate * seconds
    if load <= 0:
        billed = float(rules.min_containers) if rules.bills_idle else 0.0
        return PoolStats(billed, 0.0, 0.0, 0, k, seconds)
    spread = SIGMAS * math.sqrt(load) + SIGMAS
    lo, hi = max(0, math.floor(load - spread)), math.ceil(load + spread)
    pmf, cdf = _poisson_table(load, lo, hi)
    billed = busy = cold = 0.0
    j = 1
    while True:
        threshold = (j - 1) * cap
        if threshold > hi and j > rules.min_containers:
            break
        if threshold < lo:
            p, share = 1.0, (1.0, 1.0, 0.0)  # always busy: far below the mean load
        elif threshold > hi:
            p, share = 0.0, (0.0, 0.0, 0.0)
        else:
            i = threshold - lo
            p = 1.0 - cdf[i]
            share = _replica_share(rate, p, pmf[i], cdf[i], rules)
        if j <= rules.min_containers:
            billed += 1.0 if rules.bills_idle else p
            busy += p
        else:
            billed, busy, cold = billed + share[0], busy + share[1], cold + share[2]
        j += 1
    return PoolStats(billed, busy, cold, replicas_needed(load, cap), k, seconds)


def steady_pool(rate: float, seconds: float, k: float, cap: int, rules: Rules) -> PoolStats:
    load = rate * seconds
    pinned = float(rules.min_containers) if rules.bills_idle else 0.0
    if load <= 0:
        return PoolStats(pinned, 0.0, 0.0, 0, k, seconds)
    needed = replicas_needed(load, cap)
    busy = load / k
    idle_gap = 1.0 / rate - seconds
    if not rules.bills_idle:
        return PoolStats(
            busy, busy, 0.0 if load >= 1 or idle_gap <= rules.window_s else rate, needed, k, seconds
        )
    if load >= 1 or idle_gap <= rules.window_s or rules.min_containers >= 1:
        # Gaps never outlive the window (or a container is pinned): replicas simply stay up.
        return PoolStats(max(pinned, float(needed)), busy, 0.0, needed, k, seconds)
    per_arrival = seconds + rules.window_s + (rules.cold_start_s if rules.bills_setup else 0.0)
    return PoolStats(min(1.0, rate * per_arrival), busy, rate, needed, k, seconds)
