"""One cost function per billing mode. Each returns a ModeResult that carries its working."""

from __future__ import annotations

from dataclasses import dataclass, field

from cost_model.catalogue import (
    BillingRules,
    PerRequestEntry,
    PerSecondEntry,
    PerTokenEntry,
    ReservedEntry,
)
from cost_model.constants import DAYS_PER_MONTH, HOURS_PER_DAY, SECONDS_PER_DAY, TOKENS_PER_MILLION
from cost_model.pool import Latency
from cost_model.queueing import (
    PoolStats,
    Rules,
    effective_concurrency,
    poisson_pool,
    sharing,
    steady_pool,
)
from cost_model.service import ServiceProfile
from cost_model.workload import Workload


@dataclass(frozen=True)
class Overrides:
    """Command-line changes to the platform rules (None keeps the catalogue's value)."""

    concurrency: int | None = None
    window_s: float | None = None
    min_containers: int | None = None
    bills_setup: bool | None = None
    bills_idle: bool | None = None
    cpu_cores: float = 1.0
    memory_gib: float = 16.0
    max_containers: int = 1000
    seed: int = 17


@dataclass(frozen=True)
class ModeResult:
    entry_id: str
    platform: str
    mode: str
    requests_per_day: float
    cost_per_day: float
    billable_seconds_per_day: float | None = None
    replicas_at_peak: int | None = None
    cold_starts_per_day: float | None = None
    cold_start_fraction: float | None = None
    working: tuple[str, ...] = field(default=())
    output_tokens: int = 1
    waited_share: float | None = None  # requests that waited on a container start-up
    queued_share: float | None = None  # requests that waited because max containers were busy
    ttft: Latency | None = None
    e2e: Latency | None = None

    @property
    def cost_per_request(self) -> float:
        return self.cost_per_day / self.requests_per_day

    @property
    def cost_per_million_output(self) -> float:
        return self.cost_per_request / self.output_tokens * TOKENS_PER_MILLION

    @property
    def cost_per_month(self) -> float:
        return self.cost_per_day * DAYS_PER_MONTH


def resolve_rules(rules: BillingRules, service: ServiceProfile, ov: Overrides) -> Rules:
    def pick(value, default):  # noqa: ANN001, ANN202 - tiny local helper
        return default if value is None else value

    return Rules(
        bills_setup=pick(ov.bills_setup, rules.bills_setup),
        bills_idle=pick(ov.bills_idle, rules.bills_idle),
        window_s=float(pick(ov.window_s, rules.scaledown_window_s)),
        min_containers=int(pick(ov.min_containers, rules.min_containers)),
        concurrency=int(pick(ov.concurrency, rules.concurrency_per_replica)),
        cold_start_s=service.cold_start_s,
    )


def _pool(workload: Workload, service: ServiceProfile, rules: Rules) -> list[tuple[float, PoolStats]]:
    """(segment seconds, pool statistics) for every segment of the day."""
    cap = effective_concurrency(service, rules.concurrency)
    out = []
    for seg in workload.segments():
        k, seconds = sharing(
            seg.rate_per_s, service, workload.output_tokens, cap, seg.poisson, workload.prompt_tokens
        )
        model = poisson_pool if seg.poisson else steady_pool
        out.append((seg.seconds, model(seg.rate_per_s, seconds, k, cap, rules)))
    return out


def peak_replicas(workload: Workload, service: ServiceProfile, rules: Rules) -> int:
    return max(stats.replicas for _, stats in _pool(workload, service, rules))


def per_second(
    entry: PerSecondEntry,
    platform: BillingRules,
    workload: Workload,
    service: ServiceProfile,
    ov: Overrides,
) -> ModeResult:
    """Serverless GPU billed per second of replica uptime (what is billed follows the rules)."""
    rules = resolve_rules(platform, service, ov)
    extras = (
        ov.cpu_cores * platform.cpu_usd_per_core_second + ov.memory_gib * platform.memory_usd_per_gib_second
    )
    price = entry.usd_per_second + extras
    pool = _pool(workload, service, rules)
    billable = sum(secs * s.billed for secs, s in pool)
    colds = sum(secs * s.cold_per_s for secs, s in pool)
    peak = max(max(s.replicas for _, s in pool), rules.min_containers)
    first = pool[0][1]
    billed_what = "+".join(
        n for n, on in (("setup", rules.bills_setup), ("idle", rules.bills_idle), ("active", True)) if on
    )
    working = (
        f"request time S = {first.request_s:.2f} s with {first.sharing:.2f} streams sharing a replica "
        f"(concurrency limit {effective_concurrency(service, rules.concurrency)})",
        f"billed {billed_what}; scale-down window {rules.window_s:g} s; min containers {rules.min_containers}; "
        f"cold start {rules.cold_start_s:g} s",
        f"{billable:,.0f} replica-s/day x ${price:.7f}/s"
        + (f" (GPU ${entry.usd_per_second:.7f} + CPU/memory ${extras:.7f})" if extras else ""),
    )
    return ModeResult(
        entry.id,
        entry.platform,
        "per-second",
        workload.requests_per_day,
        billable * price,
        billable_seconds_per_day=billable,
        replicas_at_peak=peak,
        cold_starts_per_day=colds,
        cold_start_fraction=colds / workload.requests_per_day,
        working=working,
        output_tokens=workload.output_tokens,
    )


def reserved(
    entry: ReservedEntry,
    platform: BillingRules,
    workload: Workload,
    service: ServiceProfile,
    ov: Overrides,
) -> ModeResult:
    """Machines rented by the hour: enough for the peak, paid all day."""
    rules = resolve_rules(platform, service, ov)
    machines = max(1, peak_replicas(workload, service, rules), rules.min_containers)
    cost = machines * entry.usd_per_hour * HOURS_PER_DAY
    working = (f"{machines} machine(s) for the peak x 24 h x ${entry.usd_per_hour:.4f}/h",)
    return ModeResult(
        entry.id,
        entry.platform,
        "reserved",
        workload.requests_per_day,
        cost,
        billable_seconds_per_day=machines * SECONDS_PER_DAY,
        replicas_at_peak=machines,
        cold_starts_per_day=0.0,
        cold_start_fraction=0.0,
        working=working,
        output_tokens=workload.output_tokens,
    )


def per_token(entry: PerTokenEntry, workload: Workload) -> ModeResult:
    """Hosted API billed per input and output token; the host absorbs idle and cold starts."""
    per_req = (
        workload.prompt_tokens * entry.usd_per_million_input
        + workload.output_tokens * entry.usd_per_million_output
    ) / TOKENS_PER_MILLION
    working = (
        f"{workload.prompt_tokens} in x ${entry.usd_per_million_input}/M + "
        f"{workload.output_tokens} out x ${entry.usd_per_million_output}/M = ${per_req:.6f}/request",
    )
    return ModeResult(
        entry.id,
        entry.platform,
        "per-token",
        workload.requests_per_day,
        per_req * workload.requests_per_day,
        working=working,
        output_tokens=workload.output_tokens,
    )


def per_request(entry: PerRequestEntry, workload: Workload) -> ModeResult:
    """A flat price per request, whatever its size."""
    working = (f"${entry.usd_per_request}/request x {workload.requests_per_day:,.0f} requests/day",)
    return ModeResult(
        entry.id,
        entry.platform,
        "per-request",
        workload.requests_per_day,
        entry.usd_per_request * workload.requests_per_day,
        working=working,
        output_tokens=workload.output_tokens,
    )
