"""The benchmark's own bookkeeping: what it reads from /proc and from server logs."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
import uvicorn

from bench.__main__ import main as bench_main
from bench.levels import Meters, run_levels
from bench.loadgen import Sample, run_level, summarise
from bench.report import markdown_table
from bench.requesters import http_requester, load_client
from bench.servers import logged_batch_tokens, process_cpu_s
from bench.targets import bench_http
from bench.workload import Workload
from shared.http.api import create_app
from shared.settings import Settings
from tests.conftest import free_port
from tests.scripted import ScriptedEngine


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


def test_a_cells_ttft_is_the_median_of_the_runs_p50s() -> None:
    level = {**_level(1), "runs_ttft_p50_s": [0.09, 0.02, 0.05]}  # the kept run's own p50: 0.01
    assert "· 50.0 ·" in markdown_table(_report({"raw": {"levels": [level]}}))
    assert "· 10.0 ·" in markdown_table(_report({"raw": {"levels": [_level(1)]}}))  # one run


def test_prefix_cache_hit_rate_and_preset_ratio_are_in_the_table() -> None:
    cached = {**_level(256), "prefix_cache": {"queries": 100, "hits": 3, "hit_rate": 0.03}}
    cached["runs_output_tokens_per_s"] = [90.0, 100.0, 110.0]
    targets = {"bundle:throughput": {"levels": [cached]}, "vllm_server:defaults": {"levels": [_level(256)]}}
    table = markdown_table(_report(targets))
    assert "100 ±10% · 10.0 · 1.0/2.0 · 3.0%" in table
    assert "bundle:throughput / vllm_server:defaults" in table


def test_every_request_of_a_suite_gets_its_own_prompt_and_every_target_the_same() -> None:
    async def collect(workload: Workload) -> list[list[int]]:
        sent: list[list[int]] = []

        async def runner(prompts: list[list[int]], level: int) -> dict:
            sent.extend(prompts)
            return {**_level(level), "output_tokens": 1, "errors": 0}

        await run_levels(runner, workload, [1, 8, 32], rounds=2, repeat=3)
        return sent

    first, second = asyncio.run(collect(Workload())), asyncio.run(collect(Workload()))
    assert first == second  # target A's prompts are target B's
    assert len({tuple(p) for p in first}) == len(first) == 3 * (16 + 16 + 64)
    assert all(16 <= token < 1000 for prompt in first for token in prompt)
    warm_up = Workload().prompts(4, "warm-up")
    assert not {tuple(p) for p in warm_up} & {tuple(p) for p in first}


def test_output_spread_draws_each_requests_length_the_same_for_every_target() -> None:
    workload = Workload(output_tokens=100, output_spread=0.5)
    prompts = workload.prompts(400, "c256/r0")
    lengths = [workload.output_length(p) for p in prompts]
    assert lengths == [Workload(output_tokens=100, output_spread=0.5).output_length(p) for p in prompts]
    assert min(lengths) >= 50 and max(lengths) <= 150 and len(set(lengths)) > 50
    assert 90 < sum(lengths) / len(lengths) < 110  # uniform around 100 (400 draws)
    assert {Workload(output_tokens=100).output_length(p) for p in prompts} == {100}
    for bad in ("1", "-0.1", "half"):
        with pytest.raises(SystemExit) as refused:  # argparse: one line and exit code 2
            bench_main(["http", "--url", "http://127.0.0.1:9", "--output-spread", bad])
        assert refused.value.code == 2


def test_http_load_asks_each_request_for_its_own_length(scripted_url: str) -> None:
    workload = Workload(prompt_tokens=8, output_tokens=6, vocab_size=1000, output_spread=0.5)
    (level,) = asyncio.run(bench_http(scripted_url, workload, [4], rounds=4))
    assert (level["requests"], level["errors"]) == (16, 0), level["error_kinds"]
    prompts = workload.prompts(16, "c4/r0")  # the level's prompts (bench.levels names the batch)
    assert level["output_tokens"] == sum(workload.output_length(p) for p in prompts) != 16 * 6


def test_shared_prefix_prompts_share_the_prefix_and_nothing_after_it() -> None:
    workload = Workload(prompt_tokens=8, shared_prefix_tokens=50)
    prompts = workload.prompts(20, "c4/r0") + workload.prompts(20, "c4/r1")
    assert {tuple(p[:50]) for p in prompts} == {tuple(workload.shared_prefix())}
    assert len({tuple(p[50:]) for p in prompts}) == 40
    assert all(len(p) == workload.total_prompt_tokens == 58 for p in prompts)


def test_prefix_cache_meter_reports_each_runs_own_counts() -> None:
    counts = iter([(0, 0), (128, 0), (128, 0), (384, 64)])

    async def runner(prompts: list[list[int]], level: int) -> dict:
        return {**_level(level), "output_tokens": 1, "errors": 0}

    meters = Meters(prefix_cache=lambda: next(counts))
    [level] = asyncio.run(run_levels(runner, Workload(), [1], rounds=1, repeat=2, meters=meters))
    assert level["runs_prefix_cache_hit_rate"] == [0.0, 0.25]


def test_per_token_meter_divides_each_runs_own_counter_growth_by_its_tokens() -> None:
    readings = iter([{"store_round_trips": 10.0}, {"store_round_trips": 30.0}])

    async def runner(prompts: list[list[int]], level: int) -> dict:
        return {**_level(level), "output_tokens": 40, "errors": 0}

    meters = Meters(per_token=lambda: next(readings))
    [level] = asyncio.run(run_levels(runner, Workload(), [1], rounds=1, repeat=1, meters=meters))
    assert level["store_round_trips_per_token"] == 0.5


def test_loop_stall_meter_counts_each_runs_own_stalls() -> None:
    readings = iter([0, 2, 2, 2])  # the counter before and after each of two runs

    async def runner(prompts: list[list[int]], level: int) -> dict:
        return {**_level(level), "output_tokens": 40, "errors": 0}

    meters = Meters(server_loop_stalls=lambda: next(readings))
    [level] = asyncio.run(run_levels(runner, Workload(), [1], rounds=1, repeat=2, meters=meters))
    assert level["runs_server_loop_stalls"] == [2, 0]


def test_failed_requests_are_counted_with_their_reason() -> None:
    samples = [Sample(ok=False, error="HTTP 503: b'x'")] * 2 + [Sample(ok=False), Sample(True, 0.1, 0.2, 3)]
    summary = summarise(1, samples, 1.0)
    assert summary["errors"] == 3
    assert summary["error_kinds"] == {"HTTP 503: b'x'": 2, "unknown": 1}


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


def test_importtime_summary_ranks_packages_and_modules_by_their_own_time() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    try:
        import importtime_summary
    finally:
        sys.path.pop(0)
    text = (
        "import time: self [us] | cumulative | imported package\n"
        "import time:       100 |        100 |     torch._C\n"
        "import time:      2000 |       2100 |   torch\n"
        "import time:       500 |        500 | vllm.config\n"
        "import time:       300 |       2900 | vllm\n"
    )
    rows = importtime_summary.parse(text)
    assert rows[1] == (2000, 2100, 1, "torch")
    report = importtime_summary.summary(rows, top=2)
    assert "4 modules, 0.00 s" in report
    assert report.index("torch") < report.index("vllm")  # 2.1 ms own against 0.8 ms


# --- the load client against a real server ------------------------------------------------------
@pytest.fixture(scope="module")
def scripted_url() -> Iterator[str]:
    """The app on the scripted engine under a real uvicorn."""
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(Settings(), engine=ScriptedEngine(auto=True)), port=free_port(), log_level="warning"
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{server.config.port}"
    server.should_exit = True
    thread.join(timeout=10)


@pytest.mark.parametrize("clients", [1, 2])
def test_http_load_runs_an_open_loop_on_schedule(scripted_url: str, clients: int) -> None:
    workload = Workload(prompt_tokens=8, output_tokens=3, vocab_size=1000, request_rate=40.0)
    (level,) = asyncio.run(bench_http(scripted_url, workload, [4], rounds=4, clients=clients))
    assert (level["requests"], level["errors"]) == (16, 0), level["error_kinds"]
    [rows] = level["runs_timeline_ms"]
    assert rows[-1][0] > 100  # 16 arrivals at 40/s take ~0.4 s, not a burst
    assert "ttft_first_wave_s" not in level
    # How late each client process's own loop ran (its 20 ms timer fired ~20 times a process):
    # a client that falls behind would add that to every TTFT it reports.
    assert 0.0 <= level["client_loop_lag_mean_s"] < 1.0
    assert level["runs_client_loop_lag_mean_s"] == [level["client_loop_lag_mean_s"]]


@pytest.mark.parametrize("clients", [1, 2])
def test_http_load_reads_every_token_and_usage(scripted_url: str, clients: int) -> None:
    """The aiohttp load client (bench/requesters.py), from one process and from two."""
    workload = Workload(prompt_tokens=8, output_tokens=5, vocab_size=1000)
    (level,) = asyncio.run(bench_http(scripted_url, workload, [3], rounds=2, clients=clients))
    assert (level["requests"], level["errors"]) == (16, 0), level["error_kinds"]
    assert level["output_tokens"] == 16 * 5
    assert level["ttft_s"]["p50"] > 0
    # Every request's [due, first token, end, sent], kept for bench.timelines: 3 due at once,
    # each later one only when an earlier one has ended.
    [rows] = level["runs_timeline_ms"]
    assert len(rows) == 16 and all(due <= sent < first <= end for due, first, end, sent in rows)
    ends = sorted(end for _, _, end, _ in rows)
    if clients == 1:
        assert all(due >= ends[i] for i, (due, *_) in enumerate(rows[3:]))
    assert 0.0 <= level["send_delay_s"]["p50"] <= level["send_delay_s"]["p99"] < 1.0


def test_http_load_with_random_think_times_from_two_processes(scripted_url: str) -> None:
    workload = Workload(prompt_tokens=8, output_tokens=3, vocab_size=1000, think_s=0.01, think_random=True)
    (level,) = asyncio.run(bench_http(scripted_url, workload, [2], rounds=4, clients=2))
    assert (level["requests"], level["errors"]) == (16, 0), level["error_kinds"]


def test_http_load_counts_refusals_with_the_servers_reason(scripted_url: str) -> None:
    wrong = Workload(prompt_tokens=8, output_tokens=5, vocab_size=1000, model="not-served")

    async def refused() -> dict:
        async with load_client(scripted_url) as client:
            return await run_level(http_requester(client, wrong), wrong.prompts(2, "x"), 2)

    level = asyncio.run(refused())
    assert level["errors"] == 2 and all("HTTP 404" in kind for kind in level["error_kinds"])


def test_an_open_loop_schedule_is_poisson_and_the_same_for_every_target() -> None:
    closed, open_loop = Workload(), Workload(request_rate=50.0)
    prompts = open_loop.prompts(2000, "c64/r0")
    assert closed.arrival_offsets(prompts) is None
    offsets = open_loop.arrival_offsets(prompts)
    assert offsets is not None and offsets == open_loop.arrival_offsets(open_loop.prompts(2000, "c64/r0"))
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    gaps = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
    assert 0.9 / 50 < sum(gaps) / len(gaps) < 1.1 / 50  # mean gap 1/rate (2,000 draws)
    assert offsets != open_loop.arrival_offsets(open_loop.prompts(2000, "c64/r1"))


def test_an_open_loop_sends_each_request_on_time_and_caps_those_in_flight() -> None:
    from bench.loadgen import gather_limited

    in_flight = peak = 0

    async def one(prompt: list[int]) -> Sample:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.05)
        in_flight -= 1
        return Sample(True, first_token_s=0.01, total_s=0.05, output_tokens=1)

    arrivals = [0.0, 0.0, 0.0, 0.2, 0.3]
    samples = asyncio.run(gather_limited(one, [[1]] * 5, concurrency=2, arrivals=arrivals))
    starts = [s.started_s for s in samples]
    assert peak == 2 and not any(s.first_wave for s in samples)  # no burst in an open loop
    assert starts[2] >= 0.05  # the third arrival waited for a free slot: due when one freed
    assert starts[3:] == pytest.approx([0.2, 0.3], abs=1e-6)  # the others due on schedule
    assert all(0.0 <= s.send_delay_s < 1.0 for s in samples)  # and sent then
    assert "ttft_first_wave_s" not in summarise(2, samples, 1.0)


class StoppedClock:
    """Stands for `time` in bench.loadgen: its perf_counter moves only when the test moves it."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_a_request_is_timed_from_when_it_was_due_not_from_a_late_send(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client whose loop is busy when a place comes free sends late; that wait is inside the
    request's TTFT (else a target that shares its loop with the client, raw, would leave it out).
    The clock is the test's: the busy loop is a callback, queued as the first request ends, that
    moves it by BUSY_S in the turn before the second request is sent. Exact, at any machine speed."""
    from bench import loadgen

    clock = StoppedClock()
    monkeypatch.setattr(loadgen, "time", clock)
    busy_s, took_s = 0.05, 0.01

    async def one(prompt: list[int]) -> Sample:
        await asyncio.sleep(0)  # the second request reaches its wait for a place meanwhile
        clock.advance(took_s)
        if prompt == [1]:  # the loop is busy right as the first request ends
            asyncio.get_running_loop().call_soon(clock.advance, busy_s)
        return Sample(True, first_token_s=0.005, total_s=took_s, output_tokens=1)

    first, second = asyncio.run(loadgen.gather_limited(one, [[1], [2]], concurrency=1))
    assert first.send_delay_s == 0.0 and first.started_s == 0.0
    assert second.send_delay_s == pytest.approx(busy_s)
    assert second.first_token_s == pytest.approx(0.005 + busy_s)
    assert second.total_s == pytest.approx(took_s + busy_s)
    assert second.started_s == pytest.approx(first.total_s)  # due at the first's end
    rows = summarise(1, [first, second], 1.0)["timeline_ms"]
    assert rows[1][3] - rows[1][0] == pytest.approx(busy_s * 1000)  # [due, first token, end, sent] in ms


def test_think_time_holds_a_clients_place_before_its_next_request() -> None:
    from bench.loadgen import gather_limited

    async def one(prompt: list[int]) -> Sample:
        await asyncio.sleep(0.02)
        return Sample(True, first_token_s=0.01, total_s=0.02, output_tokens=1)

    samples = asyncio.run(gather_limited(one, [[1]] * 4, concurrency=2, thinks=[0.1] * 4))
    starts = sorted(s.started_s for s in samples)
    assert starts[1] < 0.05  # the first two at once
    assert starts[2] >= 0.12  # the next only after the first ended (0.02) and thought (0.1)


def test_random_think_times_are_exponential_and_the_same_for_every_target() -> None:
    fixed, random_ = Workload(think_s=0.02), Workload(think_s=0.02, think_random=True)
    prompts = fixed.prompts(2000, "c64/r0")
    assert Workload().think_times(prompts) is None and fixed.think_times(prompts) == [0.02] * 2000
    waits = random_.think_times(prompts)
    assert waits is not None and waits == random_.think_times(fixed.prompts(2000, "c64/r0"))
    assert 0.018 < sum(waits) / len(waits) < 0.022 and len(set(waits)) == 2000  # mean 20 ms, all differ


def test_client_cpus_read_tasksets_list_syntax() -> None:
    from bench.client_processes import cpu_list

    assert cpu_list("0-3,8") == {0, 1, 2, 3, 8} and cpu_list("5") == {5} and cpu_list("") == set()


def test_a_bad_request_rate_is_refused(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        bench_main(["http", "--url", "http://127.0.0.1:9", "--request-rate", "-3"])
    assert exit_.value.code == 2
    assert "positive number of requests per second" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        bench_main(["http", "--url", "http://127.0.0.1:9", "--think-time", "soon"])
    assert exit_.value.code == 2 and "not a number" in capsys.readouterr().err


def test_timelines_leave_the_report_for_their_own_file_and_are_read_by_wave(tmp_path: Path, capsys) -> None:
    from bench import timelines

    def level(concurrency: int, delay_ms: float) -> dict:
        burst = [[0.0, 100.0 * (i + 1) + delay_ms * i, 900.0] for i in range(concurrency)]
        later = [[900.0, 950.0 + delay_ms, 1800.0]] * concurrency
        return {"concurrency": concurrency, "runs_timeline_ms": [burst + later] * 3}

    targets = {"raw": {"levels": [level(4, 0)]}, "bundle": {"levels": [level(4, 10)]}}
    taken = timelines.split_off(targets)
    assert "runs_timeline_ms" not in targets["raw"]["levels"][0] and set(taken) == {"raw", "bundle"}
    timelines.write(tmp_path, {"raw": taken["raw"]}, merge=False)
    timelines.write(tmp_path, {"bundle": taken["bundle"]}, merge=True)  # a second run beside it
    assert bench_main(["timelines", str(tmp_path / "timelines.json"), "--against", "raw"]) == 0
    out = capsys.readouterr().out
    # The bundle's delay grows along the burst (+0, +10, +20, +30 ms by quarter) and is +10 later.
    assert "first wave q1   100.0 (+0.0)" in out and "first wave q4   430.0 (+30.0)" in out
    assert "later    60.0 (+10.0)" in out
    assert bench_main(["timelines", str(tmp_path / "missing.json")]) == 2


def test_merge_puts_two_gpus_runs_in_one_table(tmp_path: Path) -> None:
    """`python -m bench merge`: a pair's two bench.json files -> one report; different
    workloads cannot share a table (exit 2, one line)."""
    import orjson

    whole = orjson.loads((Path(__file__).parent.parent / "results/h200/bench.json").read_bytes())
    parts = []
    for index, name in enumerate(["raw", "vllm_server"]):
        part = {
            **whole,
            "date": f"2026-01-0{index + 1}T00:00:00+00:00",
            "targets": {name: whole["targets"][name]},
        }
        parts.append(tmp_path / f"{name}.json")
        parts[-1].write_bytes(orjson.dumps(part))
    assert bench_main(["merge", str(tmp_path / "out"), *map(str, parts)]) == 0
    merged = orjson.loads((tmp_path / "out/bench.json").read_bytes())
    assert list(merged["targets"]) == ["raw", "vllm_server"] and merged["date"].startswith("2026-01-02")
    assert "raw" in (tmp_path / "out/bench.md").read_text()

    other = {**whole, "workload": {**whole["workload"], "output_tokens": 1}}
    (tmp_path / "other.json").write_bytes(orjson.dumps(other))
    assert bench_main(["merge", str(tmp_path / "x"), str(parts[0]), str(tmp_path / "other.json")]) == 2
    # Requests timed from when they were due (now) and from the send (reports from before
    # said nothing) share no table, merged afterwards or by a suite run into the same folder
    # (refused before it runs anything).
    assert whole["timed_from"] == "due"
    sent = {key: value for key, value in whole.items() if key != "timed_from"}
    (tmp_path / "old").mkdir()
    (tmp_path / "old/bench.json").write_bytes(orjson.dumps(sent))
    assert bench_main(["merge", str(tmp_path / "y"), str(parts[0]), str(tmp_path / "old/bench.json")]) == 2
    assert bench_main(["suite", "--targets", "raw", "--merge", "--out", str(tmp_path / "old")]) == 2


def test_timelines_show_the_later_requests_time_in_the_system(tmp_path: Path, capsys) -> None:
    from bench import timelines

    # Closed loop of 2: two due at 0; each later one is due at an end and sent 5 ms after it.
    # 11 tokens out. Rows: [due, first token, end, sent].
    rows = [
        [0.0, 100.0, 300.0, 0.0],
        [0.0, 120.0, 320.0, 0.0],
        [300.0, 405.0, 605.0, 305.0],
        [320.0, 445.0, 625.0, 325.0],
    ]
    steady = timelines.steady_state(rows, 2, output_tokens=11)
    assert steady == {
        "start to end": 305.0,
        "TTFT": 115.0,
        "per token after the first": 19.0,
        "sent after due (median)": 5.0,
        "first wave: longest gap between first tokens": 20.0,  # 100 -> 120 ms
    }
    # Files from before the fourth column: the first is the send, the delay read off the ends.
    old_rows = [[0.0, 100.0, 300.0], [0.0, 120.0, 320.0], [305.0, 405.0, 605.0], [325.0, 445.0, 625.0]]
    assert timelines.steady_state(old_rows, 2, output_tokens=11)["sent after due (median)"] == 5.0
    (tmp_path / "timelines.json").write_bytes(orjson.dumps({"bundle": {"2": [rows]}}))
    (tmp_path / "bench.json").write_bytes(orjson.dumps({"workload": {"output_tokens": 11}}))
    assert timelines.main([str(tmp_path / "timelines.json")]) == 0
    assert "per token after the first 19.0" in capsys.readouterr().out
    assert timelines.main([str(tmp_path / "timelines.json"), "--output-tokens", "many"]) == 2


def test_the_first_wave_of_a_level_is_reported_apart_from_the_later_requests() -> None:
    """A level sends `concurrency` requests at once, then one per finished request: their TTFTs
    are reported apart (a p50 over both can straddle the two groups)."""
    from bench.loadgen import gather_limited

    async def one(prompt: list[int]) -> Sample:
        return Sample(True, first_token_s=prompt[0] / 1000, total_s=1.0, output_tokens=1)

    samples = asyncio.run(gather_limited(one, [[1]] * 4 + [[9]] * 4, concurrency=4))
    assert [s.first_wave for s in samples] == [True] * 4 + [False] * 4
    level = summarise(4, samples, 1.0)
    # (each plus the moment its coroutine took to send it: the requests are timed from when due)
    assert level["ttft_first_wave_s"]["p50"] == pytest.approx(0.001, abs=0.003)
    assert level["ttft_later_s"]["p50"] == pytest.approx(0.009, abs=0.003)


def test_stepped_engine_hands_out_tokens_as_vllms_stream_interval_does() -> None:
    from bench.stepped import SteppedEngine
    from shared.engine.contract import SamplingRequest

    async def counts(interval: int | None) -> list[int]:
        engine = SteppedEngine(step_s=0.001)
        request = SamplingRequest(prompt_token_ids=[20], max_tokens=6, stream_interval=interval)
        return [delta.token_count async for delta in engine.generate("r", request)]

    assert asyncio.run(counts(None)) == [1] * 6
    assert asyncio.run(counts(2)) == [1, 2, 2, 1]  # the first and the last at once


async def test_stepped_engine_refuses_a_constrained_request_as_the_clients_400() -> None:
    """The stepped engine is a whole `Engine`: an output format it cannot follow is refused at
    admission (it lacked `check_constraint`, so this was an AttributeError, a 500)."""
    from bench.stepped import SteppedEngine

    app = create_app(Settings(warm_up=False), engine=SteppedEngine(step_s=0.001))
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    schema = {"type": "json_schema", "json_schema": {"name": "o", "schema": {"type": "object"}}}
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://bench") as http:
            refused = await http.post("/v1/chat/completions", json={**body, "response_format": schema})
            served = await http.post("/v1/chat/completions", json=body)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "response_format"
    assert served.status_code == 200, served.text
    assert served.json()["choices"][0]["message"]["content"] == " tok tok"


def test_stepped_benchmark_measures_the_serving_layers_cpu_per_token_both_ways(tmp_path: Path) -> None:
    args = ["stepped", "--streams", "4", "--output-tokens", "6", "--runs", "1", "--clients", "1"]
    assert bench_main([*args, "--env", "BUNDLE_STREAM_BATCH_AT=2", "--out", str(tmp_path)]) == 0
    report = orjson.loads((tmp_path / "stepped.json").read_bytes())
    assert list(report["runs"]) == ["baseline", "BUNDLE_STREAM_BATCH_AT=2"]
    for [run] in report["runs"].values():
        assert run["errors"] == 0 and 0 < run["cpu_ms_per_token"] < 1000
    assert "| BUNDLE_STREAM_BATCH_AT=2 |" in (tmp_path / "stepped.md").read_text()
    for bad in (["--env", "STREAM=1"], ["--env", "BUNDLE_X=1", "--runs", "0"]):
        try:
            code = bench_main([*args[:1], *bad, "--out", str(tmp_path)])
        except SystemExit as exc:  # argparse refuses with exit code 2 itself
            code = exc.code
        assert code == 2


def test_loop_stalls_are_read_from_the_servers_loop_lag_buckets() -> None:
    from bench.levels import STALL_S
    from bench.servers import metrics_histogram_above

    app = create_app(Settings(), engine=ScriptedEngine(auto=True))
    server = uvicorn.Server(uvicorn.Config(app, port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.02)
        url = f"http://127.0.0.1:{server.config.port}"
        stalls = metrics_histogram_above(url, "bundle_event_loop_lag_seconds", STALL_S)
        before = stalls()
        lag = app.state.service.metrics.event_loop_lag
        lag.observe(0.3)  # one stall
        lag.observe(0.01)  # and an ordinary late timer
        assert stalls() - before == 1
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    assert metrics_histogram_above("http://127.0.0.1:9", "bundle_event_loop_lag_seconds", STALL_S)() == 0


def test_loopback_write_floor_measures_writer_and_reader(tmp_path: Path) -> None:
    from bench.loopback_writes import main as loopback_main

    out = tmp_path / "loopback.json"
    arguments = ["--connections", "3", "--rounds", "4", "--step-ms", "1", "--bytes", "120"]
    assert loopback_main([*arguments, "--out", str(out)]) == 0
    result = orjson.loads(out.read_bytes())
    assert (result["connections"], result["rounds"], result["event_bytes"]) == (3, 4, 120)
    # Every write was made and read to its end: both sides spent some CPU on them.
    assert result["writer_cpu_ms_per_write"] > 0
    assert result["reader_cpu_ms_per_write"] > 0


def test_loopback_write_floor_refuses_a_too_small_event(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.loopback_writes import main as loopback_main

    with pytest.raises(SystemExit) as exit_:
        loopback_main(["--bytes", "8"])
    assert exit_.value.code == 2
    assert "--bytes must be at least 16" in capsys.readouterr().err


def test_gc_pauses_are_read_from_the_servers_metrics_per_level(scripted_url: str) -> None:
    import gc

    from bench.servers import metrics_gc_pauses

    read = metrics_gc_pauses(scripted_url)
    before = read()
    gc.collect(2)  # collections are process-wide: the server's timer sees these two
    gc.collect(2)
    after = read()
    assert after["gc_full_collections"] - before["gc_full_collections"] >= 2
    assert after["gc_full_pause_s"] > before["gc_full_pause_s"]
    assert after["gc_pause_s"] - before["gc_pause_s"] >= after["gc_full_pause_s"] - before["gc_full_pause_s"]
    assert set(metrics_gc_pauses("http://127.0.0.1:9")().values()) == {0.0}  # nobody there
    workload = Workload(prompt_tokens=8, output_tokens=3, vocab_size=1000)
    meters = Meters(server_gc=read)
    (level,) = asyncio.run(bench_http(scripted_url, workload, [2], rounds=8, meters=meters))
    assert set(level["server_gc"]) == {"gc_pause_s", "gc_full_collections", "gc_full_pause_s"}
    assert all(value >= 0 for value in level["server_gc"].values())


# --- several API processes (issue 39) -----------------------------------------------------------
def test_a_target_names_its_api_processes_and_the_bundle_gets_them_in_its_environment() -> None:
    from bench.specs import BadTarget, TargetSpec

    spec = TargetSpec.parse("bundle@4")
    assert (spec.kind, spec.processes, spec.name) == ("bundle", 4, "bundle@4")
    assert spec.server_env(True)["BUNDLE_API_PROCESSES"] == "4"
    assert "BUNDLE_API_PROCESSES" not in TargetSpec.parse("bundle").server_env(True)
    assert TargetSpec.parse("vllm_server:defaults@2").name == "vllm_server:defaults@2"
    for bad in ("raw@2", "bundle@0", "bundle@", "bundle@two"):
        with pytest.raises(BadTarget):
            TargetSpec.parse(bad)


def test_vllm_servers_process_count_goes_through_vllm_serve() -> None:
    from bench.servers import vllm_server_command

    settings = Settings(enforce_eager=True, max_model_len=512)
    several = vllm_server_command(settings, 8123, api_servers=4)
    assert several[1:5] == ["-m", "bench.vllm_serve", "--api-server-count", "4"]
    one = vllm_server_command(settings, 8123)
    assert one[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and "--api-server-count" not in one


def test_cpu_by_process_is_reported_per_token_and_tabled_with_the_busiest_api_process() -> None:
    readings = iter([
        {"api": 1.0, "api.0": 0.4, "api.1": 0.6, "engine": 2.0, "other": 0.0},
        {"api": 1.3, "api.0": 0.5, "api.1": 0.8, "engine": 2.4, "other": 0.01},
    ])  # fmt: skip

    async def runner(prompts: list[list[int]], level: int) -> dict:
        return {**_level(level), "output_tokens": 100, "errors": 0}

    meters = Meters(process_cpu=lambda: next(readings))
    [level] = asyncio.run(run_levels(runner, Workload(), [4], rounds=1, repeat=1, meters=meters))
    cpu = level["cpu_ms_per_token"]
    assert cpu["api"] == pytest.approx(3.0) and cpu["api.1"] == pytest.approx(2.0)
    assert cpu["engine"] == pytest.approx(4.0) and cpu["other"] == pytest.approx(0.1)
    table = markdown_table(_report({"bundle@2": {"levels": [level]}, "raw": {"levels": [_level(4)]}}))
    assert "| 4 | 3.000 (2.000) · 4.000 · 0.100 |" in table
    assert "bundle@2 / raw" in table


def test_the_1b_shape_is_llama_3_2_1bs_config_only(tmp_path: Path) -> None:
    from shared.models.tiny_model import ensure_model

    built = ensure_model(tmp_path, "llama3-1b")
    config = orjson.loads((built / "config.json").read_bytes())
    shape = {key: config[key] for key in ("hidden_size", "intermediate_size", "num_hidden_layers")}
    assert shape == {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16}
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (32, 8)
    rope_theta = config.get("rope_theta") or config["rope_parameters"]["rope_theta"]  # transformers 5
    assert (config["vocab_size"], rope_theta) == (128256, 500000.0)
    assert config["tie_word_embeddings"] is True
    assert not list(built.glob("*.safetensors"))  # vLLM's dummy load fills the weights
    assert Settings(tiny_model_shape="llama3-1b").tiny_model_shape == "llama3-1b"
