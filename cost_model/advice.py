"""Settings advice for a per-second serverless entry: concurrency, scale-down window, minimum containers."""

from __future__ import annotations

from dataclasses import dataclass, replace

from cost_model.billing import Overrides, per_second, resolve_rules
from cost_model.catalogue import BillingRules, PerSecondEntry
from cost_model.service import ServiceProfile
from cost_model.workload import Workload

CONCURRENCY_CHOICES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
WINDOW_CHOICES = (2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0)
NEAR_BEST = 1.02  # within 2% of the cheapest counts as "as cheap"


@dataclass(frozen=True)
class Advice:
    setting: str
    value: str
    reason: str


def _cost(entry: PerSecondEntry, rules: BillingRules, w: Workload, s: ServiceProfile, ov: Overrides):
    return per_second(entry, rules, w, s, ov)


def advise_concurrency(
    entry: PerSecondEntry, rules: BillingRules, w: Workload, s: ServiceProfile, ov: Overrides
) -> Advice:
    results = {c: _cost(entry, rules, w, s, replace(ov, concurrency=c)) for c in CONCURRENCY_CHOICES}
    best = min(r.cost_per_request for r in results.values())
    # The smallest limit that is about as cheap keeps per-stream speed highest.
    pick = next(c for c in CONCURRENCY_CHOICES if results[c].cost_per_request <= best * NEAR_BEST)
    speed = s.per_stream_rate(min(pick, s.max_measured_concurrency))
    return Advice(
        "concurrency per replica",
        str(pick),
        f"${results[pick].cost_per_request:.6f}/request, within 2% of the cheapest limit; "
        f"higher limits save nothing at this load; streams still get ~{speed:.0f} tok/s "
        f"(limit 1 would cost ${results[1].cost_per_request:.6f}/request)",
    )


def advise_window(
    entry: PerSecondEntry,
    rules: BillingRules,
    w: Workload,
    s: ServiceProfile,
    ov: Overrides,
    max_cold_fraction: float,
) -> Advice:
    results = {win: _cost(entry, rules, w, s, replace(ov, window_s=win)) for win in WINDOW_CHOICES}
    ok = [win for win in WINDOW_CHOICES if (results[win].cold_start_fraction or 0) <= max_cold_fraction]
    if ok:
        pick = min(ok, key=lambda win: results[win].cost_per_day)
        why = (
            f"cheapest window keeping cold starts at or under {max_cold_fraction:.0%} of requests "
            f"({results[pick].cold_start_fraction:.1%}, {results[pick].cold_starts_per_day:.0f}/day)"
        )
    else:
        pick = WINDOW_CHOICES[-1]
        why = (
            f"no window keeps cold starts under {max_cold_fraction:.0%} at this rate; the longest one "
            f"still has {results[pick].cold_start_fraction:.0%} - consider a minimum container"
        )
    return Advice("scale-down window", f"{pick:g} s", f"{why}; ${results[pick].cost_per_month:,.2f}/month")


def advise_min_containers(
    entry: PerSecondEntry,
    rules: BillingRules,
    w: Workload,
    s: ServiceProfile,
    ov: Overrides,
    max_cold_fraction: float,
) -> Advice:
    zero = _cost(entry, rules, w, s, replace(ov, min_containers=0))
    one = _cost(entry, rules, w, s, replace(ov, min_containers=1))
    extra = one.cost_per_month - zero.cost_per_month
    if (zero.cold_start_fraction or 0) <= max_cold_fraction:
        return Advice(
            "minimum containers",
            "0",
            f"scale to zero already keeps cold starts at {zero.cold_start_fraction:.1%} of requests; "
            f"one warm container would add ${extra:,.2f}/month",
        )
    return Advice(
        "minimum containers",
        "1",
        f"scale to zero cold-starts {zero.cold_start_fraction:.0%} of requests "
        f"(+{s.cold_start_s:g} s each); a warm container removes most of that for "
        f"${extra:,.2f}/month more",
    )


def advise(
    entry: PerSecondEntry,
    rules: BillingRules,
    w: Workload,
    s: ServiceProfile,
    ov: Overrides,
    max_cold_fraction: float = 0.01,
) -> list[Advice]:
    resolved = resolve_rules(rules, s, ov)
    conc = advise_concurrency(entry, rules, w, s, ov)
    tuned = replace(ov, concurrency=int(conc.value), min_containers=resolved.min_containers)
    return [
        conc,
        advise_window(entry, rules, w, s, tuned, max_cold_fraction),
        advise_min_containers(entry, rules, w, s, tuned, max_cold_fraction),
    ]
