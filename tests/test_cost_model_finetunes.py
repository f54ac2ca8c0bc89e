"""N fine-tunes: one deployment serving LoRA adapters against N deployments (issue 32).

Both sides come from the same simulation and billing functions as the main table, so these tests
hold the comparison to what those bills imply, not to figures of its own.
"""

from __future__ import annotations

import json

import pytest

from cost_model.billing import Overrides
from cost_model.catalogue import load_packaged
from cost_model.cli import main
from cost_model.constants import SECONDS_PER_DAY
from cost_model.finetunes import LoraPlan, compare, lora_service
from cost_model.service import from_flags
from cost_model.workload import Workload

CAT = load_packaged()
SERVICE = from_flags(None, "1:100,8:90,32:60", 0.2, 30.0)
DAY = Workload(requests_per_day=2000, prompt_tokens=200, output_tokens=300)
MIXED = (
    "modal-h100,runpod-flex-h100,runpod-active-h100,together-llama-3.1-8b,replicate-meta-llama-3-8b-instruct"
)


def _rows(n: int, entries: str = MIXED, overhead: float = 0.0, ov: Overrides | None = None) -> dict:
    ft = compare(CAT, CAT.pick(entries), DAY, SERVICE, ov or Overrides(concurrency=8), LoraPlan(n, overhead))
    return {r.entry: r for r in ft.rows}


def test_one_fine_tune_costs_the_same_both_ways() -> None:
    for row in _rows(1).values():
        assert row.separate.cost_per_month == pytest.approx(row.shared.cost_per_month, rel=1e-12), row.entry
        assert row.saving_per_month == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("entry", ["modal-h100", "runpod-flex-h100"])
def test_idle_windows_and_start_ups_make_more_deployments_cost_more(entry: str) -> None:
    # Each extra deployment brings its own start-ups and idle windows (both billed on these
    # platforms) while the traffic, and so the busy time, stays the same in total.
    costs = [_rows(n, entry)[entry].separate.cost_per_month for n in (1, 2, 4, 8)]
    starts = [_rows(n, entry)[entry].separate.cold_starts_per_day for n in (1, 2, 4, 8)]
    assert all(a < b for a, b in zip(costs, costs[1:], strict=False)) and costs[-1] > 1.5 * costs[0], costs
    assert all(a < b for a, b in zip(starts, starts[1:], strict=False)), starts


def test_per_token_bills_do_not_depend_on_deployments() -> None:
    rows = _rows(7)
    for entry in ("together-llama-3.1-8b", "replicate-meta-llama-3-8b-instruct"):
        assert rows[entry].mode == "per-token"
        assert rows[entry].separate.cost_per_month == pytest.approx(
            rows[entry].shared.cost_per_month, rel=1e-12
        )


def test_minimum_containers_are_paid_once_per_deployment() -> None:
    n = 5
    row = _rows(n, "modal-h100", ov=Overrides(concurrency=8, min_containers=1))["modal-h100"]
    assert row.separate.billable_seconds_per_day >= n * SECONDS_PER_DAY  # type: ignore[operator]
    assert row.shared.billable_seconds_per_day < 2 * SECONDS_PER_DAY  # type: ignore[operator]
    assert row.saving_per_month > 0.7 * (n - 1) / n * row.separate.cost_per_month


def test_reserved_machines_are_bought_per_deployment() -> None:
    row = _rows(3, "runpod-active-h100")["runpod-active-h100"]
    assert row.separate.replicas_at_peak == 3 * row.shared.replicas_at_peak  # type: ignore[operator]
    assert row.separate.cost_per_month == pytest.approx(3 * row.shared.cost_per_month)


def test_lora_overhead_slows_and_bills_only_the_adapter_deployment() -> None:
    plain, slow = _rows(4, "modal-h100"), _rows(4, "modal-h100", overhead=0.5)
    assert slow["modal-h100"].separate == plain["modal-h100"].separate  # merged fine-tunes: no adapters
    assert slow["modal-h100"].shared.e2e.p50 > plain["modal-h100"].shared.e2e.p50  # type: ignore[union-attr]
    assert slow["modal-h100"].shared.cost_per_month > plain["modal-h100"].shared.cost_per_month
    svc = lora_service(SERVICE, 0.25)
    assert svc.per_stream_rate(8) == pytest.approx(SERVICE.per_stream_rate(8) / 1.25)
    assert svc.prefill_tokens_per_s == pytest.approx(SERVICE.prefill_tokens_per_s / 1.25)


@pytest.mark.slow
def test_cli_shows_both_sides_and_the_saving(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["estimate", "--requests-per-day", "2000", "--throughput", "1:100,8:90", "--concurrency", "8"]
    argv += ["--entries", "modal-h100,together-llama-3.1-8b"]
    assert main([*argv, "--fine-tunes", "4", "--lora-overhead", "0", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    ft = doc["fine_tunes"]
    assert ft["fine_tunes"] == 4 and ft["lora_overhead"] == 0 and ft["requests_per_day_each"] == 500
    rows = {r["entry"]: r for r in ft["rows"]}
    table = {r["entry"]: r for r in doc["results"]}
    # With no overhead the one-deployment side is the main table's own row.
    assert rows["modal-h100"]["one_deployment_cost_per_month"] == table["modal-h100"]["cost_per_month"]
    assert rows["modal-h100"]["saving_per_month"] > 0
    assert rows["modal-h100"]["working"][0].startswith("each of 4 deployments: simulated")
    assert main([*argv, "--fine-tunes", "4", "--lora-overhead", "0.2"]) == 0
    out = capsys.readouterr().out
    assert "4 fine-tunes: one deployment serving 4 LoRA adapters, LoRA overhead 20% per token, against" in out
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fine_tunes"] is None


def test_the_default_lora_overhead_is_the_h200_measurement() -> None:
    """DEFAULT_LORA_OVERHEAD is what `bash bench/gpu.sh lora` measured: the base's tokens/s over
    the adapters' (medians of the runs), less one, in the committed JSON."""
    from pathlib import Path
    from statistics import median

    from cost_model.finetunes import DEFAULT_LORA_OVERHEAD

    targets = json.loads(Path("results/h200/lora/lora.json").read_text())["targets"]
    base, lora = (median(targets[name]["runs_output_tokens_per_s"]) for name in ("base", "lora"))
    assert round(base / lora - 1, 2) == DEFAULT_LORA_OVERHEAD
