"""Benchmark: 200 request rates over every catalogue entry. Run: python -m cost_model sweep-bench."""

from __future__ import annotations

import time

from cost_model.billing import Overrides
from cost_model.breakeven import log_grid
from cost_model.catalogue import load_packaged
from cost_model.estimate import evaluate
from cost_model.service import from_flags
from cost_model.workload import Workload

RATES = 200


def sweep() -> tuple[int, float]:
    """Evaluate every entry at every rate; return (evaluations, seconds)."""
    cat = load_packaged()
    service = from_flags(None, "1:500,8:400,32:250", 0.1, 30.0)
    workload = Workload(requests_per_day=1000, prompt_tokens=100, output_tokens=1000)
    overrides = Overrides(concurrency=8)
    rates = log_grid(10.0, 1e7, RATES)
    start = time.perf_counter()
    count = 0
    for entry in cat.entries:
        for rate in rates:
            evaluate(cat, entry, workload.with_rate(rate), service, overrides)
            count += 1
    return count, time.perf_counter() - start


def main() -> None:
    count, seconds = sweep()
    print(f"{count} evaluations ({RATES} rates x {count // RATES} catalogue entries) in {seconds:.3f} s")


if __name__ == "__main__":
    main()
