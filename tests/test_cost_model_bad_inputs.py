"""Every bad input exits 2 with one line on stderr (the table in docs/cost-model.md lists them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cost_model.cli import main

BASE = ["estimate", "--requests-per-day", "1000", "--throughput", "1:100,8:80", "--concurrency", "8"]
GOOD_BENCH = Path(__file__).parent / "cost_model_fixtures" / "bench_small.json"

# (label, extra flags, file content written to FILE (None: no file), expected text in the error)
CASES: list[tuple[str, list[str], str | None, str]] = [
    ("rate nan", ["--requests-per-day", "nan"], None, "finite"),
    ("rate inf", ["--requests-per-day", "inf"], None, "finite"),
    ("rate negative", ["--requests-per-day", "-5"], None, "within"),
    ("rate zero", ["--requests-per-day", "0"], None, "within"),
    ("rate huge", ["--requests-per-day", "1e30"], None, "within"),
    ("rate not a number", ["--requests-per-day", "lots"], None, "wants a number"),
    ("hourly rate huge", ["--requests-per-hour", "1e12"], None, "within"),
    ("peak factor inf", ["--arrival", "peak", "--peak-factor", "inf"], None, "finite"),
    ("peak too long", ["--arrival", "peak", "--peak-factor", "10", "--peak-hours", "10"], None, "exceeds 24 h"),
    ("prompt tokens negative", ["--prompt-tokens", "-1"], None, "within"),
    ("prompt tokens float", ["--prompt-tokens", "1.5"], None, "whole number"),
    ("output tokens huge", ["--output-tokens", "10000000000"], None, "within"),
    ("output tokens zero", ["--output-tokens", "0"], None, "within"),
    ("tokens/s nan", ["--tokens-per-s", "nan"], None, "finite"),
    ("throughput nan", ["--throughput", "1:nan"], None, "bad --throughput"),
    ("throughput inf concurrency", ["--throughput", "inf:100"], None, "bad --throughput"),
    ("throughput garbage", ["--throughput", "fast"], None, "bad --throughput"),
    (
        "throughput too many points",
        ["--throughput", ",".join(f"{i}:10" for i in range(1, 100))],
        None,
        "at most",
    ),
    ("single point, concurrency 8", ["--throughput", "", "--tokens-per-s", "50"], None, "one speed point"),
    ("ttft negative", ["--ttft", "-1"], None, "within"),
    ("cold start a year", ["--cold-start", "31536000"], None, "within"),
    ("cold start -inf", ["--cold-start=-inf"], None, "finite"),
    ("concurrency zero", ["--concurrency", "0"], None, "within"),
    ("concurrency huge", ["--concurrency", "100000000"], None, "within"),
    ("window nan", ["--scaledown-window", "nan"], None, "finite"),
    ("min above max", ["--min-containers", "5", "--max-containers", "2"], None, "exceeds"),
    ("max containers huge", ["--max-containers", "1000000000"], None, "within"),
    ("price per second inf", ["--price-per-second", "inf"], None, "finite"),
    ("price per million nan", ["--price-per-million-tokens", "nan,1"], None, "finite"),
    ("price per million one value", ["--price-per-million-tokens", "1"], None, "IN,OUT"),
    ("billed without active", ["--billed", "idle"], None, "--billed"),
    ("p95 target zero", ["--p95-ttft-s", "0"], None, "within"),
    ("unknown GPU", ["--gpu", "Z80"], None, "unknown GPU"),
    ("unknown entry", ["--entries", "nope"], None, "unknown entry 'nope'"),
    ("bench missing", ["--bench", "{missing}"], None, "not found"),
    ("bench not JSON", ["--bench", "{file}"], "{not json", "cannot read benchmark"),
    ("bench wrong shape", ["--bench", "{file}"], '{"targets": {"bundle": {}}}', "malformed benchmark"),
    (
        "bench NaN speed",
        ["--bench", "{file}"],
        '{"targets": {"b": {"levels": [{"concurrency": 1, "per_stream_tokens_per_s": NaN}]}}}',
        "malformed",
    ),
    ("bench top-level list", ["--bench", "{file}"], "[1, 2]", "top level"),
    ("startup wrong schema", ["--startup", "{file}"], '{"schema": "x", "paths": {}}', "bundle-startup/1"),
    (
        "startup median inf",
        ["--startup", "{file}"],
        '{"schema": "bundle-startup/1", "paths": {"eager": {"first_token_s": {"median": Infinity}}}}',
        "not a number",
    ),
    (
        "startup only wake",
        ["--startup", "{file}"],
        '{"schema": "bundle-startup/1", "paths": {"wake": {"first_token_s": {"median": 1}}}}',
        "no cold start",
    ),
    ("startup unknown path", ["--startup", "{fixture}", "--startup-path", "warp"], None, "not in"),
    ("catalogue not JSON", ["--catalogue", "{file}"], "]]", "malformed catalogue"),
    (
        "catalogue price inf",
        ["--catalogue", "{file}"],
        '{"entries": [{"id": "x", "platform": "modal", "kind": "per_second", "gpu": "A100-80GB", '
        '"usd_per_second": 1e999, "source": "s", "read_on": "2026-01-01"}]}',
        "malformed catalogue",
    ),
    ("catalogue platforms a list", ["--catalogue", "{file}"], '{"platforms": []}', "must be an object"),
    ("seed negative", ["--seed", "-1"], None, "within"),
    ("unknown flag", ["--frobnicate"], None, "unrecognized"),
    # Issue 27: each of these computed first and failed after, or never ended, or ran everything.
    ("entries empty", ["--entries", ""], None, "at least one catalogue id"),
    (
        "entries one unknown",
        ["--entries", "modal-a100-80gb,nope"],
        None,
        "unknown entry 'nope' (valid: modal-h100",
    ),
    ("plot format unknown", ["--plot", "{file}.xyz"], None, "unknown format 'xyz' (matplotlib writes: "),
    ("plot folder missing", ["--plot", "{missing}/p.png"], None, "does not exist"),
    ("bench /dev/zero", ["--bench", "/dev/zero"], None, "not a regular file"),
    ("catalogue a directory", ["--catalogue", "{dir}"], None, "it is a directory"),
    ("startup not UTF-8", ["--startup", "{file}"], "\udcff", "not UTF-8"),
    (
        "catalogue min containers huge",
        ["--catalogue", "{file}"],
        '{"platforms": {"modal": {"bills_setup": true, "bills_idle": true, "scaledown_window_s": 60, '
        '"min_containers": 1000000000}}}',
        "min_containers",
    ),
    ("startup path without file", ["--startup-path", "eager"], None, "needs --startup"),
    ("fine-tunes zero", ["--fine-tunes", "0"], None, "within"),
    ("fine-tunes share too small", ["--fine-tunes", "1000", "--requests-per-day", "5"], None, "per deployment"),
    ("LoRA overhead alone", ["--lora-overhead", "0.1"], None, "needs --fine-tunes"),
]


@pytest.mark.parametrize("label, extra, content, needle", CASES, ids=[c[0] for c in CASES])
def test_bad_input_one_line_exit_2(
    label: str,
    extra: list[str],
    content: str | None,
    needle: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    f = tmp_path / "input.json"
    if content is not None:
        f.write_text(content, errors="surrogateescape")  # "\udcff": the lone byte 0xff, not UTF-8
    fixture = str(Path(__file__).parent / "cost_model_fixtures" / "startup_small.json")
    names = {"file": f, "missing": tmp_path / "missing.json", "fixture": fixture, "dir": tmp_path}
    argv = [a.format(**names) for a in BASE + extra]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, label
    assert needle in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
