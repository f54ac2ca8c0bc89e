"""Dispatch catalogue entries to their billing function."""

from __future__ import annotations

from collections.abc import Sequence

from cost_model import billing
from cost_model.billing import ModeResult, Overrides
from cost_model.catalogue import Catalogue, Entry
from cost_model.service import ServiceProfile
from cost_model.workload import Workload


def evaluate(
    cat: Catalogue, entry: Entry, workload: Workload, service: ServiceProfile, ov: Overrides
) -> ModeResult:
    if entry.kind == "per_second":
        return billing.per_second(entry, cat.rules_for(entry), workload, service, ov)
    if entry.kind == "reserved_hourly":
        return billing.reserved(entry, cat.rules_for(entry), workload, service, ov)
    if entry.kind == "per_token":
        return billing.per_token(entry, workload)
    return billing.per_request(entry, workload)


def evaluate_all(
    cat: Catalogue,
    entries: Sequence[Entry],
    workload: Workload,
    service: ServiceProfile,
    ov: Overrides,
) -> list[ModeResult]:
    return [evaluate(cat, e, workload, service, ov) for e in entries]


def monthly_cost(
    cat: Catalogue,
    entry: Entry,
    workload: Workload,
    service: ServiceProfile,
    ov: Overrides,
    requests_per_day: float,
) -> float:
    return evaluate(cat, entry, workload.with_rate(requests_per_day), service, ov).cost_per_month
