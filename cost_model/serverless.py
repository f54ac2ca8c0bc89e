"""Price the simulated pool: per-second serverless rows and reserved machines, with latency."""

from __future__ import annotations

import math

from cost_model.billing import ModeResult, Overrides, peak_replicas, resolve_rules
from cost_model.catalogue import BillingRules, PerSecondEntry, ReservedEntry
from cost_model.constants import HOURS_PER_DAY, SECONDS_PER_DAY
from cost_model.pool import PoolDay, simulate_pool
from cost_model.service import ServiceProfile
from cost_model.simulate import PoolConfig
from cost_model.workload import Workload


def _billed(day: PoolDay, rules: BillingRules | object, setup: bool, idle: bool) -> tuple[float, float]:
    """(flex, pinned) container-seconds per day that the platform bills."""
    flex = (day.setup_s if setup else 0.0) + (day.flex_up_s if idle else day.flex_busy_s)
    return flex, day.pinned_s if idle else day.pinned_busy_s


def simulated_per_second(
    entry: PerSecondEntry, platform: BillingRules, w: Workload, s: ServiceProfile, ov: Overrides
) -> ModeResult:
    rules = resolve_rules(platform, s, ov)
    cfg = PoolConfig(rules.concurrency, rules.window_s, rules.min_containers, ov.max_containers, s.cold_start_s)
    day = simulate_pool(w, s, cfg, ov.seed)
    flex, pinned = _billed(day, platform, rules.bills_setup, rules.bills_idle)
    extras = (
        ov.cpu_cores * platform.cpu_usd_per_core_second + ov.memory_gib * platform.memory_usd_per_gib_second
    )
    flex_price = entry.usd_per_second + extras
    pinned_price = (entry.usd_per_second_min_container or entry.usd_per_second) + extras
    cost = flex * flex_price + pinned * pinned_price
    what = "+".join(
        n for n, on in (("setup", rules.bills_setup), ("idle", rules.bills_idle), ("active", True)) if on
    )
    working = (
        f"simulated {day.simulated_requests:,} requests (seed {ov.seed}); concurrency {cfg.concurrency}, "
        f"window {rules.window_s:g} s, min {rules.min_containers}, max {ov.max_containers}, "
        f"start-up {s.cold_start_s:g} s",
        f"billed {what}: {flex:,.0f} flex s/day x ${flex_price:.7f}"
        + (f" + {pinned:,.0f} minimum-container s/day x ${pinned_price:.7f}" if pinned else ""),
        f"{day.waited_share:.1%} of requests waited on a start-up, {day.queued_share:.1%} on max containers",
    )
    return ModeResult(
        entry.id,
        entry.platform,
        "per-second",
        w.requests_per_day,
        cost,
        billable_seconds_per_day=flex + pinned,
        replicas_at_peak=day.peak_containers,
        cold_starts_per_day=day.starts,
        cold_start_fraction=day.starts / w.requests_per_day,
        working=working,
        output_tokens=w.output_tokens,
        waited_share=day.waited_share,
        queued_share=day.queued_share,
        ttft=day.ttft,
        e2e=day.e2e,
    )


def simulated_reserved(
    entry: ReservedEntry, platform: BillingRules, w: Workload, s: ServiceProfile, ov: Overrides
) -> ModeResult:
    """Enough always-on machines for the peak (Little's law); the simulation gives their latency."""
    rules = resolve_rules(platform, s, ov)
    machines = max(1, peak_replicas(w, s, rules), rules.min_containers)
    cfg = PoolConfig(rules.concurrency, math.inf, machines, machines, 0.0)
    day = simulate_pool(w, s, cfg, ov.seed)
    return ModeResult(
        entry.id,
        entry.platform,
        "reserved",
        w.requests_per_day,
        machines * entry.usd_per_hour * HOURS_PER_DAY,
        billable_seconds_per_day=machines * SECONDS_PER_DAY,
        replicas_at_peak=machines,
        cold_starts_per_day=0.0,
        cold_start_fraction=0.0,
        working=(f"{machines} machine(s) for the peak x 24 h x ${entry.usd_per_hour:.4f}/h",),
        output_tokens=w.output_tokens,
        waited_share=0.0,
        queued_share=day.queued_share,
        ttft=day.ttft,
        e2e=day.e2e,
    )
