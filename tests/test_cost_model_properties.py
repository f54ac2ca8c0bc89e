"""Property tests: monotonicity of the serverless model and the meaning of a break-even."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cost_model import billing
from cost_model.billing import Overrides
from cost_model.breakeven import crossings
from cost_model.catalogue import BillingRules, PerTokenEntry
from cost_model.service import ServiceProfile, ThroughputPoint
from cost_model.workload import Arrival, Workload
from tests.test_cost_model import ENTRY  # one $0.001/s test GPU for both modules


@st.composite
def services(draw: st.DrawFn) -> ServiceProfile:
    # Per-stream speed falls gently with concurrency, so aggregate throughput rises everywhere
    # (also between the interpolated points); where it falls, more streams really can cost more.
    base = draw(st.floats(20, 500))
    slope = draw(st.floats(0.0, 0.01))
    levels = [1, 4, 16, 64]
    pts = tuple(
        ThroughputPoint(concurrency=c, per_stream_tokens_per_s=base / (1 + slope * (c - 1))) for c in levels
    )
    return ServiceProfile(
        points=pts, ttft_s=draw(st.floats(0.0, 2.0)), cold_start_s=draw(st.floats(0.0, 120.0))
    )


rules_st = st.builds(
    BillingRules,
    bills_setup=st.booleans(),
    bills_idle=st.just(True),
    scaledown_window_s=st.floats(2.0, 1200.0),
    min_containers=st.just(0),
    concurrency_per_replica=st.integers(1, 64),
)
arrivals = st.sampled_from([Arrival.POISSON, Arrival.PEAK, Arrival.STEADY])


def cost(
    rate: float, svc: ServiceProfile, rules: BillingRules, arrival: Arrival, ov: Overrides
) -> billing.ModeResult:
    w = Workload(requests_per_day=rate, arrival=arrival, prompt_tokens=100, output_tokens=300)
    return billing.per_second(ENTRY, rules, w, svc, ov)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(
    svc=services(),
    rules=rules_st,
    arrival=arrivals,
    lo=st.floats(1.0, 2e6),
    ratio=st.floats(1.0, 50.0),
)
def test_cost_never_falls_when_rate_rises(svc, rules, arrival, lo, ratio) -> None:  # noqa: ANN001
    low = cost(lo, svc, rules, arrival, Overrides()).cost_per_day
    high = cost(lo * ratio, svc, rules, arrival, Overrides()).cost_per_day
    assert high >= low * (1 - 1e-9)


@settings(max_examples=300, deadline=None)
@given(
    svc=services(),
    rules=rules_st,
    arrival=arrivals,
    rate=st.floats(1.0, 2e6),
    c1=st.integers(1, 64),
    extra=st.integers(1, 64),
)
def test_more_concurrency_never_raises_cost_per_request(svc, rules, arrival, rate, c1, extra) -> None:  # noqa: ANN001
    few = cost(rate, svc, rules, arrival, Overrides(concurrency=c1)).cost_per_request
    many = cost(rate, svc, rules, arrival, Overrides(concurrency=c1 + extra)).cost_per_request
    assert many <= few * (1 + 1e-9)


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(svc=services(), rules=rules_st, tok_price=st.floats(0.02, 5.0))
def test_break_even_is_where_curves_cross(svc, rules, tok_price) -> None:  # noqa: ANN001
    token = PerTokenEntry(
        id="t",
        platform="p",
        kind="per_token",
        usd_per_million_input=tok_price,
        usd_per_million_output=tok_price,
        source="t",
        read_on="2026-11-29",
    )

    def serverless(rate: float) -> float:
        return cost(rate, svc, rules, Arrival.POISSON, Overrides()).cost_per_month

    def per_token(rate: float) -> float:
        w = Workload(requests_per_day=rate, prompt_tokens=100, output_tokens=300)
        return billing.per_token(token, w).cost_per_month

    for be in crossings("s", serverless, "t", per_token, 1.0, 1e7):
        if not be.continuous:
            continue
        a, b = serverless(be.requests_per_day), per_token(be.requests_per_day)
        assert abs(a - b) <= 1e-3 * max(a, b)
        # Close to the crossing: the per-second curve has steps (whole replicas), so a wide
        # window can hold another crossing that flips the order back.
        below, above = be.requests_per_day * 0.999, be.requests_per_day * 1.001
        assert (serverless(below) - per_token(below)) * (serverless(above) - per_token(above)) < 0
