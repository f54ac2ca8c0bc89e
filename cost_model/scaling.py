"""Streams per container from the measured curves: where the time to first token meets an objective.

`python -m cost_model.scaling --bench results/h200/bench.json --ttft-sla-s 0.5` reads the
benchmark's TTFT-vs-streams curve (the bundle target) with the cost model's own interpolation
(`ServiceProfile.ttft`: linear between measured levels) at two quantiles, and says how many
concurrent streams one container can hold with
- P99 TTFT within the objective (the later waves' P99: a steady state, not the cold first wave):
  the autoscaling target, Modal's `target_inputs` and Replicate's `concurrency.max`, where a
  container should stop taking more so that the objective holds;
- P50 TTFT within the objective: Modal's `max_inputs`, the most a container may take while a new
  one starts (the burst above the target), beyond which most requests would miss the objective.
docs/observability.md, "Scaling signals", shows the figures and what they assume.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from cost_model.benchfile import PREFERRED_TARGET
from cost_model.service import ServiceProfile, ThroughputPoint


def ttft_profile(levels: list[dict[str, Any]], quantile: str, later: bool) -> ServiceProfile:
    """The curve with each level's TTFT at `quantile` (of the later waves when `later`)."""
    key = "ttft_later_s" if later else "ttft_s"
    points = [
        ThroughputPoint(
            concurrency=level["concurrency"],
            per_stream_tokens_per_s=level["output_tokens_per_s"] / level["concurrency"],
            ttft_s=level[key][quantile],
        )
        for level in levels
        if level.get("output_tokens_per_s")
    ]
    return ServiceProfile(points=tuple(points), label=f"TTFT {quantile}")


def streams_within(profile: ServiceProfile, ttft_s: float) -> int:
    """The most streams whose interpolated TTFT stays within `ttft_s` (at least 1: one stream is
    what a container serves however slow it is), up to the last measured level."""
    top = int(profile.points[-1].concurrency)
    within = [k for k in range(1, top + 1) if profile.ttft(k) <= ttft_s]
    return max(within, default=1)


def advise(bench: dict[str, Any], ttft_sla_s: float) -> dict[str, Any]:
    targets = bench["targets"]
    levels = (targets.get(PREFERRED_TARGET) or next(iter(targets.values())))["levels"]
    target = streams_within(ttft_profile(levels, "p99", later=True), ttft_sla_s)
    burst = streams_within(ttft_profile(levels, "p50", later=True), ttft_sla_s)
    return {
        "ttft_sla_s": ttft_sla_s,
        "machine": bench.get("machine"),
        "model": bench.get("model"),
        "workload": bench.get("workload"),
        "measured": [
            {
                "streams": level["concurrency"],
                "ttft_p50_s": level["ttft_later_s"]["p50"],
                "ttft_p99_s": level["ttft_later_s"]["p99"],
                "tokens_per_s": level["output_tokens_per_s"],
            }
            for level in levels
        ],  # fmt: skip
        "modal_target_inputs": target,
        "modal_max_inputs": max(burst, target),
        "cog_concurrency_max": target,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench", type=Path, required=True, help="a bench JSON (bundle-bench/1)")
    parser.add_argument("--ttft-sla-s", type=float, default=0.5, help="the objective (BUNDLE_TTFT_SLA_S)")
    args = parser.parse_args()
    print(json.dumps(advise(json.loads(args.bench.read_text()), args.ttft_sla_s), indent=2))


if __name__ == "__main__":
    main()
