"""The event simulation: against closed forms, against hand-worked scenarios, and its time bound."""

from __future__ import annotations

import math
import time

import pytest

from cost_model import billing
from cost_model.billing import Overrides
from cost_model.pool import simulate_pool
from cost_model.service import from_flags
from cost_model.simulate import PoolConfig
from cost_model.workload import Arrival, Workload
from tests.test_cost_model import ENTRY, SCALE_TO_ZERO, SERVICE

DAY = 86400.0


def wl(per_day: float, arrival: Arrival = Arrival.POISSON, prompt: int = 100, out: int = 1000) -> Workload:
    return Workload(requests_per_day=per_day, arrival=arrival, prompt_tokens=prompt, output_tokens=out)


def pool(concurrency: int = 8, window: float = 60.0, minimum: int = 0, maximum: int = 1000) -> PoolConfig:
    return PoolConfig(concurrency, window, minimum, maximum, 30.0)


def billed(day) -> float:  # noqa: ANN001 - a PoolDay
    return day.setup_s + day.flex_up_s + day.pinned_s


@pytest.mark.parametrize("per_day", [300.0, 1000.0, 3000.0])
def test_simulation_matches_closed_form_for_one_replica(per_day: float) -> None:
    # One replica at a time (load << 8 streams) and Poisson arrivals: the renewal-cycle closed form
    # is exact there, so the simulation must agree with it within 1 %.
    day = simulate_pool(wl(per_day), SERVICE, pool(), budget=200_000)
    closed = billing.per_second(ENTRY, SCALE_TO_ZERO, wl(per_day), SERVICE, Overrides())
    assert billed(day) == pytest.approx(closed.billable_seconds_per_day, rel=0.01)
    assert day.starts == pytest.approx(closed.cold_starts_per_day, rel=0.03)


def test_hand_worked_steady_arrivals_all_cold() -> None:
    # 100 requests/day, evenly 864 s apart; window 60 s, start-up 30 s, request 2.1 s.
    # Each request finds no container: start-up 30 + work 2.1 + idle 60 = 92.1 s billed,
    # 100 x 92.1 = 9,210 s/day; everyone waits 30 s, so TTFT = 30 + 0.1 = 30.1 s, e2e 32.1 s.
    day = simulate_pool(wl(100, Arrival.STEADY), SERVICE, pool())
    assert billed(day) == pytest.approx(9210.0, rel=1e-3)
    assert day.starts == pytest.approx(100.0, rel=1e-3)
    assert day.waited_share == pytest.approx(1.0)
    assert day.ttft.p50 == pytest.approx(30.1, abs=1e-6)
    assert day.e2e.p99 == pytest.approx(32.1, abs=1e-6)


def test_hand_worked_steady_arrivals_stay_warm() -> None:
    # 2,000/day: 43.2 s apart, idle gaps 41.1 s < 60 s window. Only the very first request ever
    # starts a container (30 days simulated: 1 start / 30 days); after that it never stops, so the
    # day is billed in full less the first arrival's phase (< 43.2 s over 30 days), TTFT 0.1 s.
    day = simulate_pool(wl(2000, Arrival.STEADY), SERVICE, pool())
    assert billed(day) == pytest.approx(DAY, rel=1e-3)
    assert day.starts == pytest.approx(1 / 30)
    assert day.ttft.p99 == pytest.approx(0.1, abs=1e-6)


def test_hand_worked_queue_behind_max_containers() -> None:
    # One container, one stream, minimum 1 (always warm), 2.1 s per request, arrivals every 1.728 s
    # (50,000/day): load 1.215 > 1, so the queue grows by 0.372 s per request without limit; the
    # median request has waited ~ 0.372 x n/2, far beyond the 0.1 s TTFT, and nothing starts cold.
    day = simulate_pool(wl(50_000, Arrival.STEADY), SERVICE, pool(concurrency=1, minimum=1, maximum=1))
    assert day.starts == 0 and day.queued_share > 0.99
    assert day.ttft.p50 > 100 * 0.1
    assert billed(day) == pytest.approx(DAY)


def test_min_containers_remove_start_up_waits() -> None:
    cold = simulate_pool(wl(1000), SERVICE, pool())
    warm = simulate_pool(wl(1000), SERVICE, pool(minimum=1))
    assert cold.waited_share > 0.3 and warm.waited_share == 0.0
    assert warm.ttft.p95 == pytest.approx(0.1, abs=1e-6) and cold.ttft.p95 == pytest.approx(30.1, abs=1e-6)


def test_readme_peak_scenario_reports_start_up_waits() -> None:
    # The README's peak scenario on RunPod's 5 s window: the old "cold starts" figure counted only the
    # request that triggered a start (about 1 %); the share that waits on a start-up is far higher.
    svc = from_flags(None, "1:205,16:190,64:137,256:49", 0.025, 120.0)
    w = Workload(
        requests_per_day=50_000,
        arrival=Arrival.PEAK,
        peak_factor=3,
        peak_hours=4,
        prompt_tokens=512,
        output_tokens=256,
    )
    day = simulate_pool(w, svc, PoolConfig(64, 5.0, 0, 1000, 120.0))
    assert day.waited_share > 0.2


def test_same_seed_same_answer_other_seed_close() -> None:
    a = simulate_pool(wl(5000), SERVICE, pool(), seed=1)
    b = simulate_pool(wl(5000), SERVICE, pool(), seed=1)
    c = simulate_pool(wl(5000), SERVICE, pool(), seed=2)
    assert a == b and billed(c) == pytest.approx(billed(a), rel=0.02)


def test_a_month_of_a_million_requests_a_day_is_bounded() -> None:
    # Orders of magnitude only: the sample is bounded, so this is well under the 10 s promise.
    w = wl(1_000_000, Arrival.PEAK, prompt=512, out=256)
    start = time.perf_counter()
    day = simulate_pool(w, SERVICE, PoolConfig(1, 60.0, 0, 10_000, 30.0), seed=3)
    assert time.perf_counter() - start < 10.0
    assert day.simulated_requests < 200_000 and math.isfinite(billed(day))
