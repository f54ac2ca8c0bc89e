"""Put an estimate together: results per entry, break-evens between modes, advice, snapshots."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from cost_model.advice import Advice, advise
from cost_model.billing import ModeResult, Overrides
from cost_model.breakeven import BreakEven, crossings
from cost_model.catalogue import Catalogue, Entry
from cost_model.estimate import evaluate_all, monthly_cost, simulate
from cost_model.finetunes import FineTunes, LoraPlan, compare
from cost_model.service import ServiceProfile
from cost_model.workload import Workload

RATE_RANGE = (10.0, 1e7)  # requests/day searched for break-evens and drawn in the plot


@dataclass(frozen=True)
class Analysis:
    workload: Workload
    service: ServiceProfile
    overrides: Overrides
    results: list[ModeResult]
    representatives: dict[str, Entry]
    break_evens: list[BreakEven]
    advice: list[Advice]
    p95_target_s: float
    notes: list[str]
    snapshot: list[str]
    fine_tunes: FineTunes | None = None  # --fine-tunes N: one LoRA deployment against N deployments


def representatives(entries: list[Entry], results: list[ModeResult]) -> dict[str, Entry]:
    """The cheapest entry of each billing mode at the workload's rate."""
    best: dict[str, tuple[float, Entry]] = {}
    for entry, res in zip(entries, results, strict=True):
        if res.mode not in best or res.cost_per_day < best[res.mode][0]:
            best[res.mode] = (res.cost_per_day, entry)
    return {mode: e for mode, (_, e) in best.items()}


def _cost_at(cat: Catalogue, e: Entry, w: Workload, s: ServiceProfile, ov: Overrides, rate: float) -> float:
    """Monthly cost at one rate: bound per entry with partial (a lambda's default argument types are
    not inferred)."""
    return monthly_cost(cat, e, w, s, ov, rate)


def mode_break_evens(
    cat: Catalogue, reps: dict[str, Entry], w: Workload, s: ServiceProfile, ov: Overrides
) -> list[BreakEven]:
    found: list[BreakEven] = []
    items = list(reps.values())
    for i, a in enumerate(items):
        for b in items[i + 1 :]:
            found += crossings(
                a.id,
                partial(_cost_at, cat, a, w, s, ov),
                b.id,
                partial(_cost_at, cat, b, w, s, ov),
                *RATE_RANGE,
            )
    return sorted(found, key=lambda be: be.requests_per_day)


def snapshot_savings(
    cat: Catalogue,
    rows: list[tuple[Entry, ModeResult]],
    w: Workload,
    s: ServiceProfile,
    ov: Overrides,
    snapshot_start_s: float | None,
) -> list[str]:
    """What restoring from a GPU snapshot instead of a cold start saves, per serverless row."""
    if snapshot_start_s is None:
        return []
    fast = s.model_copy(update={"cold_start_s": snapshot_start_s})
    lines = []
    for entry, cold in rows:
        if cold.mode != "per-second":
            continue
        snap = simulate(cat, entry, w, fast, ov)
        lines.append(
            f"{entry.id}: ${cold.cost_per_month:,.2f} -> ${snap.cost_per_month:,.2f}/month "
            f"(saves ${cold.cost_per_month - snap.cost_per_month:,.2f}); p95 TTFT "
            f"{cold.ttft.p95:.2f} -> {snap.ttft.p95:.2f} s"  # type: ignore[union-attr]
        )
    return lines


def analyse(
    cat: Catalogue,
    entries: list[Entry],
    w: Workload,
    s: ServiceProfile,
    ov: Overrides,
    notes: list[str],
    p95_target_s: float,
    flat_ok: bool = False,
    snapshot_start_s: float | None = None,
    lora: LoraPlan | None = None,
) -> Analysis:
    results = evaluate_all(cat, entries, w, s, ov)
    rows = list(zip(entries, results, strict=True))
    reps = representatives(entries, results)
    return Analysis(
        w,
        s,
        ov,
        results,
        reps,
        mode_break_evens(cat, reps, w, s, ov),
        advise(cat, rows, w, s, ov, flat_ok, p95_target_s),
        p95_target_s,
        notes,
        snapshot_savings(cat, rows, w, s, ov, snapshot_start_s),
        None if lora is None else compare(cat, entries, w, s, ov, lora),
    )
