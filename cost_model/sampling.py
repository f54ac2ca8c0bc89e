"""Which stretch of time the simulation runs: whole days when they are small, slices when not.

Up to `budget` requests a day, whole days are simulated back to back (as many as the budget
allows, at most MAX_DAYS), so daily peaks and the ramps between them are in the sample. Above it,
each part of the day (peak, off-peak) is simulated as its own stationary slice that starts from a
warm pool and is scaled up to the part's length; the ramp between parts is then not in the
sample, which at such rates is one round of start-ups a day among hundreds of thousands of
requests. Either way the number of simulated requests is bounded, whatever the inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from cost_model.constants import SECONDS_PER_DAY
from cost_model.workload import Arrival, Segment, Workload

MAX_DAYS = 365
MIN_SLICE_S = 1800.0  # long enough for start-ups and idle windows to play out many times


@dataclass(frozen=True)
class Slice:
    """Sorted arrival times in [0, horizon); totals x per_day are figures per day."""

    arrivals: np.ndarray
    horizon: float
    per_day: float
    warm: int


def _arrivals(seg: Segment, start: float, seconds: float, rng: np.random.Generator) -> np.ndarray:
    if not seg.poisson:
        gap = 1.0 / seg.rate_per_s
        first = start + rng.uniform(0.0, gap)
        return np.arange(first, start + seconds, gap)
    count = rng.poisson(seg.rate_per_s * seconds)
    return np.sort(rng.uniform(start, start + seconds, count))


def whole_days(w: Workload, budget: int, rng: np.random.Generator) -> Slice:
    days = int(min(MAX_DAYS, max(1, budget // max(w.requests_per_day, 1.0))))
    horizon = days * SECONDS_PER_DAY
    if w.arrival is Arrival.STEADY:  # one even spacing across day boundaries, not a new phase each day
        seg = w.segments()[0]
        return Slice(_arrivals(seg, 0.0, horizon, rng), horizon, 1.0 / days, 0)
    parts, t = [], 0.0
    for _ in range(days):
        for seg in w.segments():
            parts.append(_arrivals(seg, t, seg.seconds, rng))
            t += seg.seconds
    return Slice(np.concatenate(parts), days * SECONDS_PER_DAY, 1.0 / days, 0)


def slices(w: Workload, budget: int, rng: np.random.Generator, warm: Callable[[float], int]) -> list[Slice]:
    share = budget / w.requests_per_day
    out = []
    for seg in w.segments():
        seconds = min(seg.seconds, max(seg.seconds * share, MIN_SLICE_S), budget / seg.rate_per_s)
        out.append(
            Slice(_arrivals(seg, 0.0, seconds, rng), seconds, seg.seconds / seconds, warm(seg.rate_per_s))
        )
    return out


def plan(w: Workload, budget: int, seed: int, warm: Callable[[float], int]) -> list[Slice]:
    rng = np.random.default_rng(seed)
    if w.requests_per_day <= budget:
        return [whole_days(w, budget, rng)]
    return slices(w, budget, rng, warm)
