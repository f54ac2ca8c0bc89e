"""Put an estimate together: results per entry, break-evens between modes, advice."""

from __future__ import annotations

from dataclasses import dataclass

from cost_model.advice import Advice, advise
from cost_model.billing import ModeResult, Overrides
from cost_model.breakeven import BreakEven, crossings
from cost_model.catalogue import Catalogue, Entry
from cost_model.estimate import evaluate_all, monthly_cost
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
    advice_for: str | None
    notes: list[str]


def representatives(entries: list[Entry], results: list[ModeResult]) -> dict[str, Entry]:
    """The cheapest entry of each billing mode at the workload's rate."""
    best: dict[str, tuple[float, Entry]] = {}
    for entry, res in zip(entries, results, strict=True):
        if res.mode not in best or res.cost_per_day < best[res.mode][0]:
            best[res.mode] = (res.cost_per_day, entry)
    return {mode: e for mode, (_, e) in best.items()}


def mode_break_evens(
    cat: Catalogue, reps: dict[str, Entry], w: Workload, s: ServiceProfile, ov: Overrides
) -> list[BreakEven]:
    found: list[BreakEven] = []
    items = list(reps.values())
    for i, a in enumerate(items):
        for b in items[i + 1 :]:
            found += crossings(
                a.id,
                lambda r, e=a: monthly_cost(cat, e, w, s, ov, r),
                b.id,
                lambda r, e=b: monthly_cost(cat, e, w, s, ov, r),
                *RATE_RANGE,
            )
    return sorted(found, key=lambda be: be.requests_per_day)


def analyse(
    cat: Catalogue,
    entries: list[Entry],
    w: Workload,
    s: ServiceProfile,
    ov: Overrides,
    max_cold_fraction: float,
    notes: list[str],
) -> Analysis:
    results = evaluate_all(cat, entries, w, s, ov)
    reps = representatives(entries, results)
    serverless = reps.get("per-second")
    tips = advise(serverless, cat.rules_for(serverless), w, s, ov, max_cold_fraction) if serverless else []
    return Analysis(
        w,
        s,
        ov,
        results,
        reps,
        mode_break_evens(cat, reps, w, s, ov),
        tips,
        serverless.id if serverless else None,
        notes,
    )
