"""N fine-tunes of one base model: one deployment serving them as LoRA adapters, or N deployments.

One deployment (vLLM with LoRA enabled) serves every adapter in the same continuous batch: it
sees the sum of the traffic, its streams share the GPUs, and it pays one set of start-ups, idle
windows and minimum containers. N separate deployments (each its own model, e.g. a merged
fine-tune) each see 1/N of the traffic and pay all of that N times. Both sides are priced by the
same simulation and billing functions as the main table; nothing here has a price of its own.

Stated simplifications: the fine-tunes share the traffic equally; adapters beyond vLLM's
per-batch limit (max_loras) are not made to wait; loading adapters adds nothing to a start-up.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cost_model.billing import ModeResult, Overrides
from cost_model.catalogue import Catalogue, Entry
from cost_model.estimate import simulate
from cost_model.service import ServiceProfile
from cost_model.workload import Workload

# Extra time per token with adapters when the user gives none: measured on the H200
# (`bash bench/gpu.sh lora`, results/h200/lora/lora.json: 64 streams over 4 rank-16
# adapters on q/k/v/o gave 4,790 tok/s against 6,486 on the base, medians of 3 runs, so each
# token takes 1.35x as long). It varies with rank, adapter count and batch mix: measure yours and
# pass it with --lora-overhead. tests/test_cost_model_finetunes.py recomputes it from the JSON.
DEFAULT_LORA_OVERHEAD = 0.35


@dataclass(frozen=True)
class LoraPlan:
    fine_tunes: int
    overhead: float  # extra time per token on the adapter deployment: 0.1 = every token 10 % slower


@dataclass(frozen=True)
class FineTuneRow:
    entry: str
    mode: str
    shared: ModeResult  # one deployment, all the traffic, adapters in its batches
    separate: ModeResult  # N deployments together, each with 1/N of the traffic

    @property
    def saving_per_month(self) -> float:
        return self.separate.cost_per_month - self.shared.cost_per_month


@dataclass(frozen=True)
class FineTunes:
    plan: LoraPlan
    requests_per_day_each: float
    rows: list[FineTuneRow]


def lora_service(s: ServiceProfile, overhead: float) -> ServiceProfile:
    """The replica's speed with adapters: every token, prompt or output, takes (1 + overhead) x."""
    if overhead == 0:
        return s  # the very same profile, so the simulation's cache answers for the shared side
    slow = 1.0 + overhead
    points = tuple(
        p.model_copy(
            update={
                "per_stream_tokens_per_s": p.per_stream_tokens_per_s / slow,
                "ttft_s": None if p.ttft_s is None else p.ttft_s * slow,
            }
        )
        for p in s.points
    )
    return s.model_copy(
        update={
            "points": points,
            "ttft_s": s.ttft_s * slow,
            "prefill_tokens_per_s": s.prefill_tokens_per_s / slow,
            "label": f"{s.label} + LoRA overhead {overhead:.0%}",
        }
    )


def n_deployments(one: ModeResult, n: int, total_per_day: float) -> ModeResult:
    """N deployments alike, each with 1/N of the traffic: N times one's bill and containers.

    They are independent and identically loaded, so shares (waited, queued) and latency
    percentiles are those of one; starts per request stay the same too.
    """

    def times_n(x: float | int | None) -> float | int | None:
        return None if x is None else x * n

    return replace(
        one,
        requests_per_day=total_per_day,
        cost_per_day=one.cost_per_day * n,
        billable_seconds_per_day=times_n(one.billable_seconds_per_day),
        replicas_at_peak=times_n(one.replicas_at_peak),  # type: ignore[arg-type]
        cold_starts_per_day=times_n(one.cold_starts_per_day),
        working=tuple(f"each of {n} deployments: {line}" for line in one.working),
    )


def compare(
    cat: Catalogue, entries: list[Entry], w: Workload, s: ServiceProfile, ov: Overrides, plan: LoraPlan
) -> FineTunes:
    """Price every entry both ways; per-token and per-request rows come out equal by their bills."""
    adapters = lora_service(s, plan.overhead)
    part = w.with_rate(w.requests_per_day / plan.fine_tunes)
    rows = []
    for e in entries:
        shared = simulate(cat, e, w, adapters, ov)
        each = simulate(cat, e, part, s, ov)
        separate = n_deployments(each, plan.fine_tunes, w.requests_per_day)
        rows.append(FineTuneRow(e.id, shared.mode, shared, separate))
    return FineTunes(plan, part.requests_per_day, rows)
