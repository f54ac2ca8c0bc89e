"""`python -m cost_model pack-savings`: what a compile-cache pack saves, from measured start-ups only.

The cold-boot figures here are a fixture in the benchmark's schema (bundle-coldboot/1); the
command reads results/h200/coldboot/coldboot.json by default and says so, and refuses in one line
when that file is not there (it is made by `bash bench/gpu.sh coldboot-cog` / `coldboot-rest`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cost_model import coldboot
from cost_model.cli import main

FIXTURES = Path(__file__).parent / "cost_model_fixtures"
BOOTS = FIXTURES / "coldboot_small.json"
QUICK = ["pack-savings", "--coldboot", str(BOOTS), "--bench", str(FIXTURES / "bench_small.json")]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_the_pack_saves_setup_seconds_at_every_level(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, *QUICK, "--levels", "100,1000", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["schema"] == "cost-pack-savings/1" and doc["coldboot_file"] == str(BOOTS)
    assert doc["startup_s"] == {"empty": 124.7, "pack": 41.1}
    for level in doc["levels"]:
        cost = level["usd_per_month"]
        starts = level["cold_starts_per_day"]["empty"]
        assert starts > 0 and cost["pack"] < cost["empty"]
        # Replicate's private models bill setup: at most (124.7 - 41.1) s per start is saved, and
        # the shorter start also shortens what the first requests hold a container for.
        assert 0 < level["saved_usd_per_month"] <= starts * (124.7 - 41.1) * 0.001525 * 31 * 1.5


def test_public_models_bill_no_setup_so_the_bill_hardly_moves(capsys: pytest.CaptureFixture[str]) -> None:
    private = json.loads(run(capsys, *QUICK, "--levels", "100", "--json")[1])["levels"][0]
    public_argv = (*QUICK, "--levels", "100", "--json", "--entry", "replicate-public-gpu-h100")
    public = json.loads(run(capsys, *public_argv)[1])
    saved = public["levels"][0]["saved_usd_per_month"]
    assert abs(saved) < 0.05 * private["saved_usd_per_month"]
    assert public["levels"][0]["waited_share"]["pack"] <= public["levels"][0]["waited_share"]["empty"]


def test_the_table_names_its_file_and_both_start_ups(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, *QUICK, "--levels", "100")
    assert code == 0, err
    assert f"from {BOOTS}" in out and "empty container 124.7 s" in out and "with the pack 41.1 s" in out
    assert "saved/month" in out


def test_without_the_h200_file_it_says_what_to_run(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(coldboot, "H200_FILE", tmp_path / "absent.json")
    code, out, err = run(capsys, "pack-savings")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "results/h200/coldboot/coldboot.json is not there yet" in err and "gpu.sh coldboot-cog" in err


def test_the_h200_file_is_read_when_present(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(coldboot, "H200_FILE", BOOTS)
    bench = str(FIXTURES / "bench_small.json")
    code, out, err = run(capsys, "pack-savings", "--bench", bench, "--levels", "10")
    assert code == 0 and f"from {BOOTS}" in out, err


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--target", "serve"], "has no boot serve-empty, serve-pack (has: cog-empty, cog-pack)"),
        (["--entry", "no-such-entry"], "unknown catalogue entry"),
        (["--entry", "lambda-1x-h100-sxm"], "is not billed per second"),
        (["--levels", "0"], "--levels: 1 to 8 rates"),
        (["--levels", "a,b"], "--levels wants requests per day"),
    ],
)
def test_bad_options_are_one_line(capsys: pytest.CaptureFixture[str], argv: list[str], said: str) -> None:
    code, out, err = run(capsys, *QUICK, *argv)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert said in err, err


@pytest.mark.parametrize(
    ("document", "said"),
    [
        ({"schema": "other/1"}, "expected schema 'bundle-coldboot/1'"),
        ({"schema": "bundle-coldboot/1", "boots": {}}, "'boots' must be a non-empty object"),
        ({"schema": "bundle-coldboot/1", "boots": {"cog-empty": {"ready_s": "fast"}}}, "is not a number"),
        ({"schema": "bundle-coldboot/1", "boots": {"cog-empty": {"ready_s": -1}}}, "outside 0..3600 s"),
    ],
)
def test_malformed_files_are_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, document: dict[str, object], said: str
) -> None:
    path = tmp_path / "coldboot.json"
    path.write_text(json.dumps(document))
    code, out, err = run(capsys, "pack-savings", "--coldboot", str(path))
    assert code == 2 and said in err, err


def test_repeated_boots_count_by_their_median(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """`bench/coldboot.py --part again` adds `cog-empty-2`, `cog-pack-2`, ...: each kind's median is
    used, and a boot of another kind whose name merely starts alike (`cog-pack-old`) is not."""
    ready = {"cog-empty": 118.0, "cog-empty-2": 100.0, "cog-empty-3": 104.0, "cog-pack": 50.0,
             "cog-pack-2": 40.0, "cog-pack-old": 1.0}  # fmt: skip
    path = tmp_path / "coldboot.json"
    document = {"schema": "bundle-coldboot/1", "boots": {name: {"ready_s": s} for name, s in ready.items()}}
    path.write_text(json.dumps(document))
    bench = str(FIXTURES / "bench_small.json")
    code, out, err = run(capsys, "pack-savings", "--coldboot", str(path), "--bench", bench, "--json")
    assert code == 0, err
    assert json.loads(out)["startup_s"] == {"empty": 104.0, "pack": 45.0}
