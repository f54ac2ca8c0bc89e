"""Hand-computed checks of every billing mode, the catalogue, the bench reader and the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from cost_model import billing
from cost_model.benchfile import load_bench
from cost_model.billing import Overrides
from cost_model.breakeven import crossings
from cost_model.catalogue import BillingRules, PerSecondEntry, load_override, load_packaged
from cost_model.cli import main
from cost_model.constants import DAYS_PER_MONTH
from cost_model.errors import CostModelError
from cost_model.estimate import evaluate, monthly_cost
from cost_model.service import from_flags
from cost_model.workload import Arrival, Workload

FIXTURES = Path(__file__).parent / "cost_model_fixtures"
DAY = 86400.0

# One stream at 500 tok/s after 0.1 s to first token: a 1,000-token answer takes exactly 2.1 s.
# Prefill is made negligible (1e12 tok/s) so the hand arithmetic below stays 0.1 s + 2.0 s.
SERVICE = from_flags(500.0, None, ttft_s=0.1, cold_start_s=30.0, prefill_tokens_per_s=1e12)
ENTRY = PerSecondEntry(
    id="t",
    platform="p",
    kind="per_second",
    gpu="X",
    usd_per_second=0.001,
    source="test",
    read_on="2026-11-29",
)
SCALE_TO_ZERO = BillingRules(
    bills_setup=True,
    bills_idle=True,
    scaledown_window_s=60,
    min_containers=0,
    concurrency_per_replica=8,
)


def workload(per_day: float, arrival: Arrival = Arrival.POISSON) -> Workload:
    return Workload(requests_per_day=per_day, arrival=arrival, prompt_tokens=100, output_tokens=1000)


def test_per_token_by_hand() -> None:
    cat = load_packaged()
    res = evaluate(cat, cat.entry("replicate-meta-llama-3-8b-instruct"), workload(1000), SERVICE, Overrides())
    # 100 x $0.05/M + 1000 x $0.25/M = $0.000005 + $0.00025
    assert res.cost_per_request == pytest.approx(0.000255)
    assert res.cost_per_million_output == pytest.approx(0.255)
    assert res.cost_per_month == pytest.approx(0.255 * DAYS_PER_MONTH)


def test_reserved_by_hand() -> None:
    cat = load_packaged()
    res = evaluate(cat, cat.entry("runpod-a100-sxm-secure-cloud"), workload(1000), SERVICE, Overrides())
    # One machine is enough; it is paid 24 h a day: 1.59 x 24 = 38.16 per day.
    assert res.replicas_at_peak == 1
    assert res.cost_per_day == pytest.approx(38.16)
    assert res.cost_per_request == pytest.approx(0.03816)
    assert res.billable_seconds_per_day == DAY


def test_reserved_buys_peak_replicas() -> None:
    cat = load_packaged()
    # 400k/day at 2.1 s = 9.7 requests in flight; 8 per machine -> 2 machines.
    res = evaluate(
        cat,
        cat.entry("runpod-a100-sxm-secure-cloud"),
        workload(400_000),
        SERVICE,
        Overrides(concurrency=8),
    )
    assert res.replicas_at_peak == 2
    assert res.cost_per_day == pytest.approx(2 * 38.16)


def test_poisson_scale_to_zero_cold_starts_and_idle_by_hand() -> None:
    # 1000/day: rate = 0.011574/s, load L = rate x 2.1 = 0.024306, rate x W = 0.694444.
    # Container up fraction (no start-up): 1 - e^-0.71875 = 1 - 0.487361 = 0.512639.
    # Cold starts/s before stretching: rate x e^-0.71875 = 0.0056408; x 30 s setup = 0.169223.
    # Stretch by (1 + 0.169223): billed = (0.512639 + 0.169223) / 1.169223 = 0.583175 of the day.
    res = billing.per_second(ENTRY, SCALE_TO_ZERO, workload(1000), SERVICE, Overrides())
    assert res.billable_seconds_per_day == pytest.approx(0.583175 * DAY, rel=1e-5)
    assert res.cold_starts_per_day == pytest.approx(0.0056408 / 1.169223 * DAY, rel=1e-4)
    assert res.cost_per_day == pytest.approx(0.583175 * DAY * 0.001, rel=1e-5)
    # The naive figure (2.1 s x rate = $0.0021) is 24x too low here.
    assert res.cost_per_request > 20 * 2.1 * 0.001


def test_steady_gaps_longer_than_window_by_hand() -> None:
    # 100/day evenly: 864 s between requests > 60 s window, so every request cold-starts and
    # pays 30 s start-up + 2.1 s work + 60 s idle = 92.1 s.
    res = billing.per_second(ENTRY, SCALE_TO_ZERO, workload(100, Arrival.STEADY), SERVICE, Overrides())
    assert res.billable_seconds_per_day == pytest.approx(9210.0)
    assert res.cold_starts_per_day == pytest.approx(100.0)
    assert res.cost_per_request == pytest.approx(0.0921)


def test_steady_gaps_inside_window_stay_warm() -> None:
    # 2000/day evenly: gaps of 43.2 - 2.1 = 41.1 s < 60 s, so the container never scales down.
    res = billing.per_second(ENTRY, SCALE_TO_ZERO, workload(2000, Arrival.STEADY), SERVICE, Overrides())
    assert res.billable_seconds_per_day == pytest.approx(DAY)
    assert res.cold_starts_per_day == 0.0


def test_min_container_bills_all_day() -> None:
    res = billing.per_second(ENTRY, SCALE_TO_ZERO, workload(1000), SERVICE, Overrides(min_containers=1))
    assert res.billable_seconds_per_day == pytest.approx(DAY, rel=1e-9)
    assert res.cold_starts_per_day == pytest.approx(0.0, abs=1e-9)


def test_active_only_billing_is_request_time() -> None:
    public = SCALE_TO_ZERO.model_copy(
        update={"bills_setup": False, "bills_idle": False, "concurrency_per_replica": 1}
    )
    res = billing.per_second(ENTRY, public, workload(1000), SERVICE, Overrides())
    # 1000 requests x 2.1 s each, nothing else.
    assert res.billable_seconds_per_day == pytest.approx(2100.0, rel=1e-6)


def test_sharing_a_gpu_cuts_cost_per_request() -> None:
    curve = from_flags(None, "1:100,8:80,32:50", ttft_s=0.1, cold_start_s=30.0)
    w = workload(500_000)
    one = billing.per_second(ENTRY, SCALE_TO_ZERO, w, curve, Overrides(concurrency=1))
    eight = billing.per_second(ENTRY, SCALE_TO_ZERO, w, curve, Overrides(concurrency=8))
    assert eight.cost_per_request < one.cost_per_request / 4
    assert one.replicas_at_peak > eight.replicas_at_peak


def test_peak_segments_conserve_volume() -> None:
    w = Workload(requests_per_day=2400, arrival=Arrival.PEAK, peak_factor=3, peak_hours=4)
    total = sum(s.rate_per_s * s.seconds for s in w.segments())
    assert total == pytest.approx(2400)
    assert w.segments()[0].rate_per_s == pytest.approx(3 * 2400 / DAY)


def test_break_even_per_token_vs_reserved_by_hand() -> None:
    cat = load_packaged()
    w, ov = workload(1000), Overrides(concurrency=8)
    tok, res = (
        cat.entry("replicate-meta-llama-3-8b-instruct"),
        cat.entry("runpod-a100-sxm-secure-cloud"),
    )
    found = crossings(
        "tok",
        lambda r: monthly_cost(cat, tok, w, SERVICE, ov, r),
        "res",
        lambda r: monthly_cost(cat, res, w, SERVICE, ov, r),
        10,
        1e7,
    )
    smooth = [b for b in found if b.continuous]
    # $38.16/day / $0.000255 per request = 149,647 requests/day.
    assert smooth[0].requests_per_day == pytest.approx(38.16 / 0.000255, rel=1e-6)


def test_bench_fixture_uses_bundle_target() -> None:
    prof, cold = load_bench(FIXTURES / "bench_small.json")
    assert cold == 42.0
    assert [p.concurrency for p in prof.points] == [1, 8]
    assert prof.per_stream_rate(8) == pytest.approx(80.0)
    assert prof.per_stream_rate(4.5) == pytest.approx(90.0)  # halfway between 100 and 80
    assert prof.ttft(1) == pytest.approx(0.1)
    # Beyond the last level the aggregate (640 tok/s) is held.
    assert prof.aggregate_rate(16) == pytest.approx(640.0)


def test_bench_malformed(tmp_path: Path) -> None:
    bad = tmp_path / "b.json"
    bad.write_text(json.dumps({"targets": {"bundle": {}}}))
    with pytest.raises(CostModelError):
        load_bench(bad)


def test_catalogue_entries_have_sources_and_dates() -> None:
    cat = load_packaged()
    for e in cat.entries:
        assert e.source and e.read_on in ("2026-11-29", "2026-07-01") and e.note
    kinds = {e.kind for e in cat.entries}
    assert {"per_second", "per_token", "reserved_hourly"} <= kinds
    platforms = {e.platform for e in cat.entries}
    assert {"modal", "replicate-private", "runpod-serverless"} <= platforms


def test_catalogue_override_replaces_and_adds(tmp_path: Path) -> None:
    f = tmp_path / "c.json"
    f.write_text(
        json.dumps(
            {
                "entries": [
                    {
                        "id": "modal-h100",
                        "platform": "modal",
                        "kind": "per_second",
                        "gpu": "H100",
                        "usd_per_second": 0.002,
                        "source": "me",
                        "read_on": "2026-11-30",
                    },
                    {
                        "id": "my-api",
                        "platform": "together",
                        "kind": "per_request",
                        "usd_per_request": 0.001,
                        "source": "me",
                        "read_on": "2026-11-30",
                    },
                ]
            }
        )
    )
    cat = load_override(f, load_packaged())
    assert cat.entry("modal-h100").usd_per_second == 0.002
    assert cat.entry("my-api").kind == "per_request"


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--requests-per-day", "-5", "--tokens-per-s", "50"], "within"),
        (["--requests-per-day", "100", "--tokens-per-s", "50", "--gpu", "Z80"], "unknown GPU"),
        (["--requests-per-day", "100"], "service speed"),
        (["--requests-per-day", "100", "--tokens-per-s", "50", "--billed", "idle"], "--billed"),
    ],
)
def test_bad_input_exits_2_with_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    code, _, err = _run(capsys, "estimate", *argv)
    assert code == 2
    assert needle in err
    assert len(err.strip().splitlines()) == 1


def test_malformed_catalogue_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    f = tmp_path / "bad.json"
    f.write_text('{"entries": [{"id": "x", "kind": "per_second"}]}')
    code, _, err = _run(capsys, "estimate", "--scenario", "seed", "--catalogue", str(f))
    assert code == 2 and "malformed catalogue" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_seed_scenario_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "estimate", "--scenario", "seed", "--json")
    assert code == 0
    doc = json.loads(out)
    assert "$0.00126/request" in doc["notes"][0] and "no source" in doc["notes"][1]
    assert doc["schema"] == "cost-estimate/2" and doc["inputs"]["requests_per_day"] == 1000
    by_id = {r["entry"]: r for r in doc["results"]}
    assert by_id["modal-a100-80gb"]["price_read_on"] == "2026-07-01"
    assert by_id["modal-a100-80gb"]["ttft_s"]["p95"] > 0
    assert by_id["custom-per-request"]["cost_per_request"] == pytest.approx(0.0008)
    for platform in ("modal-a100-80gb", "replicate-gpu-a100-large", "runpod-flex-a100-80gb"):
        assert by_id[platform]["cost_per_request"] > 0.00126 * 5  # the honest figure is far higher
    assert doc["break_evens"] and doc["advice"]


@pytest.mark.slow
def test_plot_is_written(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    png = tmp_path / "p.png"
    code, _, _ = _run(capsys, "estimate", "--scenario", "seed", "--json", "--plot", str(png))
    assert code == 0 and png.stat().st_size > 10_000


def test_help_teaches(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["estimate", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "scale-down window" in out and "--scenario" in out and math.isfinite(len(out))
    assert "--startup FILE" in out and "bundle-startup/1" in out and "--snapshot-restore-s" in out


@pytest.mark.slow
def test_startup_file_feeds_cold_start_and_snapshot_savings(capsys: pytest.CaptureFixture[str]) -> None:
    startup = str(FIXTURES / "startup_small.json")
    code, out, _ = _run(
        capsys,
        "estimate",
        "--bench",
        str(FIXTURES / "bench_small.json"),
        "--requests-per-day",
        "2000",
        "--gpu",
        "H200",
        "--concurrency",
        "8",
        "--startup",
        startup,
        "--json",
    )
    doc = json.loads(out)
    assert code == 0
    # The fastest non-snapshot path of the fixture is warm-cache (median 38 s), not the bench's 42 s.
    assert doc["assumptions"]["service"]["cold_start_s"] == 38.0
    assert "path 'warm-cache'" in doc["assumptions"]["service"]["cold_start_source"]
    # Snapshot start = wake 0.82 s + default restore 20 s; it must save money on a serverless row.
    assert any("snapshot start: 20.82 s" in n for n in doc["notes"])
    assert doc["snapshot"] and "saves $" in doc["snapshot"][0]
    # The bench says test-a100, the prices are H200: warned.
    assert any(n.startswith("warning:") and "H200" in n for n in doc["notes"])


@pytest.mark.slow
def test_no_start_up_given_uses_the_stated_default(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "estimate", "--requests-per-day", "100", "--throughput", "1:50,4:40", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["assumptions"]["service"]["cold_start_s"] == 38.0
    assert doc["notes"][0].startswith("start-up: 38 s (stated default")


@pytest.mark.slow
def test_single_point_with_flag_is_accepted(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["estimate", "--requests-per-day", "100", "--tokens-per-s", "50", "--concurrency", "4"]
    assert _run(capsys, *argv)[0] == 2
    assert _run(capsys, *argv, "--assume-flat-speed", "--json")[0] == 0
