"""The benchmark's own bookkeeping: what it reads from /proc and from server logs."""

from __future__ import annotations

import os
import sys
import time
import types
from pathlib import Path

from bench.__main__ import main as bench_main
from bench.report import markdown_table
from bench.servers import logged_batch_tokens, process_cpu_s


def test_process_cpu_counts_this_process_burning_cpu() -> None:
    before_wall, before_cpu = time.process_time(), process_cpu_s(os.getpid())
    while time.process_time() - before_wall < 0.3:
        sum(range(10_000))
    used = process_cpu_s(os.getpid()) - before_cpu
    assert 0.15 < used < 3.0


def test_prefill_budget_is_read_from_either_log_style(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle.log"
    bundle.write_text("INFO [scheduler.py:252] Chunked prefill is enabled with max_num_batched_tokens=8192.\n")
    server = tmp_path / "server.log"
    server.write_text("non-default args: {'max_num_seqs': 256, 'max_num_batched_tokens': 4096}\n")
    silent = tmp_path / "silent.log"
    silent.write_text("nothing about the scheduler\n")
    assert [logged_batch_tokens(p) for p in (bundle, server, silent)] == [8192, 4096, None]


def _level(concurrency: int, cpu: float | None = None) -> dict:
    level = {
        "concurrency": concurrency,
        "output_tokens_per_s": 100.0,
        "ttft_s": {"p50": 0.01},
        "itl_s": {"p50": 0.001, "p99": 0.002},
    }
    if cpu is not None:
        level["serving_cpu_ms_per_token"] = cpu
    return level


def _report(targets: dict) -> dict:
    return {
        "machine": "m",
        "model": "tiny",
        "date": "d",
        "workload": {"prompt_tokens": 1, "output_tokens": 2},
        "targets": targets,
    }


def test_cpu_table_appears_only_where_cpu_was_measured() -> None:
    targets = {"raw": {"levels": [_level(1, 0.25)]}, "bundle": {"levels": [_level(1)]}}
    with_cpu = markdown_table(_report(targets))
    assert "CPU time of the serving process" in with_cpu
    assert "| 1 | 0.250 |" in with_cpu
    without = markdown_table(_report({"raw": {"levels": [_level(1)]}}))
    assert "CPU time" not in without


def test_startup_subcommand_hands_the_rest_of_the_line_to_its_main(monkeypatch) -> None:
    seen: list[list[str]] = []
    module = types.ModuleType("bench.startup")
    module.main = lambda argv: seen.append(argv) or 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "bench.startup", module)
    assert bench_main(["startup", "--runs", "2", "--help-me"]) == 0
    assert seen == [["--runs", "2", "--help-me"]]


def test_startup_subcommand_without_its_module_says_so_and_exits_2(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "bench.startup", None)  # as if bench/startup.py were absent
    assert bench_main(["startup"]) == 2
    assert "bench/startup.py" in capsys.readouterr().err
