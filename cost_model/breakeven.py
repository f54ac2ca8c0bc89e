"""Request rates at which two billing options cost the same per month."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

CostFn = Callable[[float], float]
GRID_POINTS = 120
BISECTIONS = 60


@dataclass(frozen=True)
class BreakEven:
    a: str
    b: str
    requests_per_day: float
    monthly_cost: float
    continuous: bool  # False when the curves jump past each other (a replica step), not cross


def log_grid(lo: float, hi: float, n: int) -> list[float]:
    step = (math.log(hi) - math.log(lo)) / (n - 1)
    return [math.exp(math.log(lo) + i * step) for i in range(n)]


def _bisect(diff: CostFn, lo: float, hi: float) -> float:
    # Bisect in log space: rates span many orders of magnitude.
    d_lo = diff(lo)
    for _ in range(BISECTIONS):
        mid = math.sqrt(lo * hi)
        d_mid = diff(mid)
        if (d_mid > 0) == (d_lo > 0):
            lo, d_lo = mid, d_mid
        else:
            hi = mid
    return math.sqrt(lo * hi)


def crossings(
    name_a: str,
    cost_a: CostFn,
    name_b: str,
    cost_b: CostFn,
    lo: float,
    hi: float,
    rel_tol: float = 1e-3,
) -> list[BreakEven]:
    """Every rate in [lo, hi] (requests/day) where the sign of cost_a - cost_b flips."""

    def diff(r: float) -> float:
        return cost_a(r) - cost_b(r)

    grid = log_grid(lo, hi, GRID_POINTS)
    values = [diff(r) for r in grid]
    found = []
    points = list(zip(grid, values, strict=True))
    for (r0, d0), (r1, d1) in zip(points, points[1:], strict=False):
        if d0 == 0 or (d0 > 0) == (d1 > 0):
            continue
        rate = _bisect(diff, r0, r1)
        a, b = cost_a(rate), cost_b(rate)
        smooth = abs(a - b) <= rel_tol * max(abs(a), abs(b), 1e-12)
        found.append(BreakEven(name_a, name_b, rate, (a + b) / 2, smooth))
    return found
