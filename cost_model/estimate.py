"""Dispatch catalogue entries to their billing function."""

from __future__ import annotations

from collections.abc import Sequence

from cost_model import billing, serverless
from cost_model.billing import ModeResult, Overrides
from cost_model.catalogue import Catalogue, Entry
from cost_model.service import ServiceProfile
from cost_model.workload import Workload


def evaluate(
    cat: Catalogue, entry: Entry, workload: Workload, service: ServiceProfile, ov: Overrides
) -> ModeResult:
    """Closed forms: fast enough for break-even searches and plots (hundreds of rates)."""
    if entry.kind == "per_second":
        return billing.per_second(entry, cat.rules_for(entry), workload, service, ov)
    if entry.kind == "reserved_hourly":
        return billing.reserved(entry, cat.rules_for(entry), workload, service, ov)
    if entry.kind == "per_token":
        return billing.per_token(entry, workload)
    return billing.per_request(entry, workload)


def simulate(
    cat: Catalogue, entry: Entry, workload: Workload, service: ServiceProfile, ov: Overrides
) -> ModeResult:
    """The event simulation where it matters (GPU rows); billing formulas elsewhere."""
    if entry.kind == "per_second":
        return serverless.simulated_per_second(entry, cat.rules_for(entry), workload, service, ov)
    if entry.kind == "reserved_hourly":
        return serverless.simulated_reserved(entry, cat.rules_for(entry), workload, service, ov)
    return evaluate(cat, entry, workload, service, ov)


def evaluate_all(
    cat: Catalogue,
    entries: Sequence[Entry],
    workload: Workload,
    service: ServiceProfile,
    ov: Overrides,
) -> list[ModeResult]:
    return [simulate(cat, e, workload, service, ov) for e in entries]


def monthly_cost(
    cat: Catalogue,
    entry: Entry,
    workload: Workload,
    service: ServiceProfile,
    ov: Overrides,
    requests_per_day: float,
) -> float:
    return evaluate(cat, entry, workload.with_rate(requests_per_day), service, ov).cost_per_month
