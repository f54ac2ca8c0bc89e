"""The estimate CLI checks every option before computing and never ends in a traceback (issue 27).

Every refusal is exit 2 with one line on stderr and nothing on stdout: an empty stdout shows that
the refusal came before the computing (the table would have been printed first otherwise).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cost_model.cli import MAX_ROWS, main
from cost_model.inputfile import MAX_INPUT_BYTES

FIXTURES = Path(__file__).parent / "cost_model_fixtures"
QUICK = ["estimate", "--requests-per-day", "1000", "--tokens-per-s", "100"]


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _refused(capsys: pytest.CaptureFixture[str], needle: str, *argv: str) -> str:
    code, out, err = _run(capsys, *argv)
    assert code == 2, err
    assert out == "", "refused only after computing"
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ") and "Traceback" not in err
    assert needle in err, err
    return err


@pytest.mark.parametrize("entries", ["modal-h100,runpod-flex-h100", "modal-h100", "runpod-flex-h100"])
def test_entries_left_at_platform_settings_render_their_advice(
    capsys: pytest.CaptureFixture[str], entries: str
) -> None:
    # Issue 27: with --entries the table's own row won the advice, and its window (left to the
    # platform, so None in the overrides) crashed the label. The label shows the setting in force.
    code, out, err = _run(capsys, *QUICK, "--entries", entries)
    assert code == 0, err
    advice = out.split("Advice", 1)[1]
    windows = {"modal-h100": "window 60 s", "runpod-flex-h100": "window 5 s"}
    assert any(e in advice and windows[e] in advice for e in entries.split(","))
    assert "None" not in advice


def test_entries_advice_in_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, *QUICK, "--entries", "runpod-active-h100,modal-h100", "--json")
    doc = json.loads(out)
    assert code == 0 and [r["entry"] for r in doc["results"]] == ["runpod-active-h100", "modal-h100"]
    assert all("None" not in tip["value"] for tip in doc["advice"])


@pytest.mark.parametrize("entries", ["", " ", ",", " , ,"])
def test_empty_entry_list_is_refused(capsys: pytest.CaptureFixture[str], entries: str) -> None:
    _refused(capsys, "at least one catalogue id", *QUICK, "--entries", entries)


def test_unknown_entry_is_named_with_the_valid_ones(capsys: pytest.CaptureFixture[str]) -> None:
    err = _refused(capsys, "unknown entry 'nope'", *QUICK, "--entries", "modal-h100,nope")
    assert "modal-h100" in err.split("valid:")[1] and "together-llama-3.1-8b" in err


def test_entry_named_twice_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    _refused(capsys, "twice", *QUICK, "--entries", "modal-h100, modal-h100")


@pytest.mark.parametrize("name", ["out.xyz", "out", "out.png.exe", ".png"])
def test_plot_format_outside_matplotlibs_list_is_refused_first(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str
) -> None:
    err = _refused(capsys, "unknown format", *QUICK, "--plot", str(tmp_path / name))
    assert "png" in err and "svg" in err  # the list is matplotlib's own
    assert not (tmp_path / name).exists()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["p.svg", "p.PDF"])
def test_plot_other_formats_matplotlib_writes(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str
) -> None:
    code, _, err = _run(capsys, *QUICK, "--entries", "modal-h100", "--json", "--plot", str(tmp_path / name))
    assert code == 0, err
    assert (tmp_path / name).stat().st_size > 1000


def test_plot_format_needing_a_missing_program_is_refused_first(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # pgf is on matplotlib's list but is written by running a TeX system.
    if shutil.which("xelatex"):
        pytest.skip("xelatex is installed here: pgf can be written")
    _refused(capsys, "xelatex, which is not installed", *QUICK, "--plot", str(tmp_path / "p.pgf"))


def test_plot_into_missing_folder_or_onto_a_folder(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    _refused(capsys, "does not exist", *QUICK, "--plot", str(tmp_path / "no" / "p.png"))
    (tmp_path / "d.png").mkdir()
    _refused(capsys, "is a directory", *QUICK, "--plot", str(tmp_path / "d.png"))


FILE_FLAGS = [
    ("--bench", "benchmark"),
    ("--startup", "start-up"),
    ("--catalogue", "catalogue"),
]


@pytest.mark.parametrize("flag, what", FILE_FLAGS)
@pytest.mark.parametrize("special", ["/dev/zero", "/dev/null"])
def test_device_files_are_refused_unread(
    capsys: pytest.CaptureFixture[str], flag: str, what: str, special: str
) -> None:
    _refused(capsys, f"cannot read {what} file {special}: not a regular file", *QUICK, flag, special)


@pytest.mark.parametrize("flag, what", FILE_FLAGS)
def test_fifo_without_writer_is_refused_not_waited_on(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, flag: str, what: str
) -> None:
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    _refused(capsys, "not a regular file", *QUICK, flag, str(fifo))


@pytest.mark.parametrize("flag, what", FILE_FLAGS)
def test_directory_and_oversized_files_are_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, flag: str, what: str
) -> None:
    _refused(capsys, "it is a directory", *QUICK, flag, str(tmp_path))
    big = tmp_path / "big.json"
    with big.open("wb") as fh:
        fh.truncate(MAX_INPUT_BYTES + 1)  # sparse: no disk or time spent
    _refused(capsys, f"more than the {MAX_INPUT_BYTES:,} allowed", *QUICK, flag, str(big))


@pytest.mark.parametrize("flag, what", FILE_FLAGS)
def test_binary_and_deeply_nested_files_are_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, flag: str, what: str
) -> None:
    f = tmp_path / "x.json"
    f.write_bytes(b"\xff\xfe\x00garbage")
    _refused(capsys, "not UTF-8", *QUICK, flag, str(f))
    f.write_text("[" * 100_000 + "]" * 100_000)
    _refused(capsys, what, *QUICK, flag, str(f))


def test_catalogue_subcommand_bounds_its_file_too(capsys: pytest.CaptureFixture[str]) -> None:
    _refused(capsys, "not a regular file", "catalogue", "--catalogue", "/dev/zero")


@pytest.mark.parametrize(
    "rules, needle",
    [
        ('"min_containers": 1000000000', "min_containers"),
        ('"concurrency_per_replica": 1000000000', "concurrency_per_replica"),
    ],
)
def test_catalogue_rules_are_bounded_like_the_flags(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, rules: str, needle: str
) -> None:
    # Unbounded, 10^9 minimum containers sized the simulated pool and never finished.
    f = tmp_path / "cat.json"
    f.write_text(
        '{"platforms": {"modal": {"bills_setup": true, "bills_idle": true, "scaledown_window_s": 60, '
        + rules
        + "}}}"
    )
    _refused(capsys, needle, *QUICK, "--catalogue", str(f))


def test_rows_to_simulate_are_bounded(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # Every GPU row is simulated: a catalogue of thousands would run for hours, so it is refused.
    rows = [
        {"id": f"g{i}", "platform": "modal", "kind": "per_second", "gpu": "A100-80GB", "usd_per_second": 0.001}
        for i in range(MAX_ROWS + 1)
    ]
    f = tmp_path / "many.json"
    f.write_text(json.dumps({"entries": [{**r, "source": "test", "read_on": "2026-12-01"} for r in rows]}))
    _refused(capsys, f"at most {MAX_ROWS}", *QUICK, "--catalogue", str(f))


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--startup-path", "eager"], "--startup-path needs --startup"),
        (["--platform", "nowhere"], "unknown --platform 'nowhere'"),
        (["--lora-overhead", "0.1"], "--lora-overhead needs --fine-tunes"),
        (["--fine-tunes", "0"], "within 1..1000"),
        (["--fine-tunes", "nan"], "whole number"),
        (["--lora-overhead", "-0.1", "--fine-tunes", "2"], "within 0..1"),
        (["--lora-overhead", "inf", "--fine-tunes", "2"], "finite"),
        (["--fine-tunes", "1000", "--requests-per-day", "5"], "0.005 requests/day per deployment, below 0.01"),
    ],
)
def test_options_ignored_or_out_of_range_are_refused(
    capsys: pytest.CaptureFixture[str], extra: list[str], needle: str
) -> None:
    _refused(capsys, needle, *QUICK, *extra)


# -- the whole argument space: exit 0 or 2, never a traceback -----------------------------------

NUMBERS = st.sampled_from(["0", "-1", "1", "2.5", "nan", "inf", "-inf", "1e309", "", "x", "64", "1e6"])
TEXT = st.sampled_from(["", " ", ",", "modal-h100", "nope", "a" * 300, "1:nan", "1:50,4:40", "\x00"])
FILES = st.sampled_from(["/dev/zero", "/dev/null", "/", "/nope.json", str(FIXTURES / "bench_small.json")])
FLAGS: dict[str, st.SearchStrategy[str]] = {
    "--requests-per-day": NUMBERS,
    "--peak-factor": NUMBERS,
    "--arrival": st.sampled_from(["steady", "poisson", "peak", "", "burst"]),
    "--prompt-tokens": NUMBERS,
    "--output-tokens": NUMBERS,
    "--tokens-per-s": NUMBERS,
    "--throughput": TEXT,
    "--ttft": NUMBERS,
    "--cold-start": NUMBERS,
    "--concurrency": NUMBERS,
    "--scaledown-window": NUMBERS,
    "--min-containers": NUMBERS,
    "--billed": st.sampled_from(["", "active", "idle", "setup,idle,active", ","]),
    "--gpu": st.sampled_from(["", "H100", "Z80", "A100-80GB"]),
    "--entries": TEXT,
    "--platform": st.sampled_from(["", "modal", "nowhere"]),
    "--price-per-million-tokens": TEXT,
    "--p95-ttft-s": NUMBERS,
    "--fine-tunes": NUMBERS,
    "--lora-overhead": NUMBERS,
    "--bench": FILES,
    "--startup": FILES,
    "--startup-path": TEXT,
    "--catalogue": FILES,
    "--plot": st.sampled_from(["", "/", "/nonexistent/p.png", "out.xyz", "x"]),
}


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chosen=st.dictionaries(st.sampled_from(sorted(FLAGS)), st.just(None), max_size=6), data=st.data())
def test_any_arguments_exit_0_or_2_without_traceback(
    capsys: pytest.CaptureFixture[str], chosen: dict[str, None], data: st.DataObject
) -> None:
    # Fast by design: a GPU entry alone keeps each valid run to one simulated row plus the advice.
    argv = ["estimate", "--entries", "modal-h100", "--requests-per-day", "100", "--tokens-per-s", "50"]
    for flag in chosen:
        argv += [flag, data.draw(FLAGS[flag], label=flag)]
    code = main(argv)  # an escaping exception fails the test: that is the traceback
    out, err = capsys.readouterr()
    assert code in (0, 2)
    if code == 2:
        assert len(err.strip().splitlines()) == 1 and err.startswith("error: ")
    assert "Traceback" not in out + err
