"""bench/otlp_overhead.py, the H200 stage's verdict, on reports shaped as the benchmark writes them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.otlp_overhead import compare

ROOT = Path(__file__).resolve().parents[1]


def report(tokens_per_s: float, cpu_ms: float) -> dict[str, Any]:
    level = {"concurrency": 256, "output_tokens_per_s": tokens_per_s, "serving_cpu_ms_per_token": cpu_ms}
    return {"machine": "test", "targets": {"bundle": {"levels": [level]}}}


def test_within_and_outside_the_bound() -> None:
    (row,) = compare(report(9800, 0.057), report(9700, 0.058))
    assert row["within_bound"] and round(row["tokens_ratio"], 3) == 0.990
    (row,) = compare(report(9800, 0.057), report(9500, 0.057))  # 3 % fewer tokens
    assert not row["within_bound"]
    (row,) = compare(report(9800, 0.057), report(9800, 0.060))  # 5 % more CPU per token
    assert not row["within_bound"]


def test_the_command_fails_when_nothing_was_exported(tmp_path: Path) -> None:
    for name, figures in (("off", (9800, 0.057)), ("on", (9790, 0.057))):
        (tmp_path / f"{name}.json").write_text(json.dumps(report(*figures)))
    (tmp_path / "sink.json").write_text(
        json.dumps({"spans": 0, "metric_points": 0, "trace_requests": 0, "metric_requests": 0})
    )
    args = [sys.executable, "-m", "bench.otlp_overhead", str(tmp_path / "off.json"), str(tmp_path / "on.json")]
    assert subprocess.run([*args, "--out", str(tmp_path / "a")], cwd=ROOT).returncode == 0
    sink = ["--sink", str(tmp_path / "sink.json")]
    assert subprocess.run([*args, *sink, "--out", str(tmp_path / "b")], cwd=ROOT).returncode == 1
    assert "| 256 |" in (tmp_path / "b" / "otlp.md").read_text()
