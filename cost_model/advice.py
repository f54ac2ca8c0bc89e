"""Advice: the cheapest setting whose simulated p95 time to first token meets a target.

Candidates span platform (every GPU row of the table), scale-down window, minimum containers and
concurrency. Their closed-form costs rank them cheaply; the simulation then checks them in that
order (at most MAX_SIMULATED) for latency and real cost. The table's own rows are candidates too,
so the pick is never beaten on both cost and p95 by a row of the same output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from cost_model.billing import ModeResult, Overrides, resolve_rules
from cost_model.catalogue import Catalogue, Entry
from cost_model.estimate import evaluate, simulate
from cost_model.queueing import Rules
from cost_model.service import ServiceProfile
from cost_model.workload import Workload

DEFAULT_P95_TTFT_S = 2.0
WINDOWS = (5.0, 30.0, 60.0, 300.0, 1200.0)
CONCURRENCY = (1, 4, 16, 64, 256)
# Settings simulated beyond the table's own rows, cheapest closed form first. Each costs up to
# ~0.3 s at a million requests a day; 5 keeps a whole estimate inside its 10 s bound on a busy
# 2-core machine (10 took 9.8 s there).
MAX_SIMULATED = 5


@dataclass(frozen=True)
class Advice:
    setting: str
    value: str
    reason: str


@dataclass(frozen=True)
class Candidate:
    entry: Entry
    overrides: Overrides
    result: ModeResult
    rules: Rules  # the settings in force: overrides resolved against the platform's defaults


def _candidate(cat: Catalogue, s: ServiceProfile, e: Entry, o: Overrides, r: ModeResult) -> Candidate:
    return Candidate(e, o, r, resolve_rules(cat.rules_for(e), s, o))


def _concurrency_choices(s: ServiceProfile, flat_ok: bool, current: int) -> list[int]:
    if len(s.points) == 1 and not flat_ok:
        return [1]
    top = s.max_measured_concurrency
    return sorted({c for c in CONCURRENCY if c <= top} | {current})


def _settings(cat: Catalogue, e: Entry, s: ServiceProfile, ov: Overrides, flat_ok: bool) -> list[Overrides]:
    rules = resolve_rules(cat.rules_for(e), s, ov)
    if e.kind == "reserved_hourly":
        return [replace(ov, concurrency=c) for c in _concurrency_choices(s, flat_ok, rules.concurrency)]
    out = []
    for c in _concurrency_choices(s, flat_ok, rules.concurrency):
        for win in sorted(set(WINDOWS) | {rules.window_s}):
            for m in sorted({0, 1, rules.min_containers}):
                out.append(replace(ov, concurrency=c, window_s=win, min_containers=m))
    return out


def _label(c: Candidate) -> str:
    # From the resolved rules, not the overrides: a table row keeps the user's overrides, where a
    # setting left to the platform is None (e.g. no --scaledown-window), yet it is in force.
    r = c.rules
    if c.result.mode == "reserved":
        return f"{c.entry.id}, concurrency {r.concurrency}"
    return (
        f"{c.entry.id}, concurrency {r.concurrency}, window {r.window_s:g} s, min containers {r.min_containers}"
    )


def _describe(c: Candidate) -> str:
    r = c.result
    return (
        f"${r.cost_per_month:,.2f}/month, p95 TTFT {r.ttft.p95:.2f} s, "  # type: ignore[union-attr]
        f"{r.waited_share:.1%} of requests wait on a start-up"
    )


def _search(
    cat: Catalogue,
    gpu_rows: list[tuple[Entry, ModeResult]],
    w: Workload,
    s: ServiceProfile,
    ov: Overrides,
    flat_ok: bool,
    target: float,
) -> tuple[list[Candidate], Candidate | None]:
    seen = [_candidate(cat, s, e, ov, r) for e, r in gpu_rows]
    ranked = sorted(
        (
            (evaluate(cat, e, w, s, o).cost_per_month, e, o)
            for e, _ in gpu_rows
            for o in _settings(cat, e, s, ov, flat_ok)
        ),
        key=lambda t: t[0],
    )
    budget = MAX_SIMULATED
    for closed_form_cost, e, o in ranked:
        # Stop once a simulated setting meets the target for less than every one left could cost.
        if budget == 0 or any(
            c.result.ttft.p95 <= target and c.result.cost_per_month <= closed_form_cost  # type: ignore[union-attr]
            for c in seen
        ):
            break
        seen.append(_candidate(cat, s, e, o, simulate(cat, e, w, s, o)))
        budget -= 1
    meeting = [c for c in seen if c.result.ttft and c.result.ttft.p95 <= target]
    best = min(meeting, key=lambda c: (c.result.cost_per_month, c.result.ttft.p95), default=None)  # type: ignore[union-attr]
    return seen, best


def advise(
    cat: Catalogue,
    rows: list[tuple[Entry, ModeResult]],
    w: Workload,
    s: ServiceProfile,
    ov: Overrides,
    flat_ok: bool,
    target: float,
) -> list[Advice]:
    gpu_rows = [(e, r) for e, r in rows if r.ttft is not None and math.isfinite(r.ttft.p95)]
    tips: list[Advice] = []
    if gpu_rows:
        seen, best = _search(cat, gpu_rows, w, s, ov, flat_ok, target)
        if best is None:
            fastest = min(seen, key=lambda c: c.result.ttft.p95)  # type: ignore[union-attr]
            tips.append(
                Advice(
                    f"p95 TTFT <= {target:g} s",
                    "not reached",
                    f"none of {len(seen)} simulated "
                    f"settings meets it; the fastest is {_label(fastest)}: {_describe(fastest)}",
                )
            )
        else:
            tips.append(
                Advice(
                    f"cheapest with p95 TTFT <= {target:g} s",
                    _label(best),
                    f"{_describe(best)} ({len(seen)} settings simulated)",
                )
            )
    tokens = [r for _, r in rows if r.mode == "per-token"]
    if tokens:
        cheap = min(tokens, key=lambda r: r.cost_per_month)
        tips.append(
            Advice(
                "per-token API",
                cheap.entry_id,
                f"${cheap.cost_per_month:,.2f}/month; its latency is "
                "the provider's and is not modelled here, so it is shown beside, not ranked",
            )
        )
    return tips
