"""`python -m shared.bench`: the bundle against raw AsyncLLM and vLLM's own server, one after
another on the same engine settings and identical requests, so ratios hold on a noisy box.

    python -m shared.bench suite --out bench/results     # what `make bench` runs
    python -m shared.bench http --url http://127.0.0.1:8000 --label mine

Engine settings come from the usual BUNDLE_* variables (the tiny CPU model by default; on a
GPU e.g. BUNDLE_TINY_MODEL_SHAPE=llama3-8b BUNDLE_LOAD_FORMAT=dummy).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import functools
import multiprocessing
import os
import platform
import re
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, TypeAlias

import httpx
import orjson

from shared.engine import batch_token_budget, engine_args, start_llm, stop_llm
from shared.loadgen import (
    Workload,
    engine_requester,
    http_requester,
    load_client,
    run_level,
    run_level_in_processes,
    summarise,
)
from shared.settings import Settings

TARGETS = ("raw", "bundle", "vllm_server")

# CPU seconds used so far by the process that serves (the API process; for raw, the bench).
# CPU time per token is the serving layer's cost that survives a noisy machine: wall-clock
# figures on two shared cores move with whoever got the CPU, CPU seconds far less.
CpuClock: TypeAlias = Callable[[], float]


# --- one target each ------------------------------------------------------------------------------
async def bench_raw(
    settings: Settings, workload: Workload, levels: list[int], rounds: int, repeat: int = 1
) -> dict[str, Any]:
    """The floor: the same engine the bundle builds, driven in-process with no server."""
    llm = start_llm(settings)
    try:
        one = engine_requester(llm, workload)
        await run_level(one, workload.prompts(4), 4)  # warm-up: graphs, caches
        return {
            # process_time: this process's CPU, where vLLM's client side (output handling,
            # detokenizing) runs as it does in a server's API process, minus HTTP.
            "levels": await _levels(
                functools.partial(run_level, one), workload, levels, rounds, repeat, time.process_time
            ),
            "max_num_batched_tokens": batch_token_budget(llm),
        }
    finally:
        stop_llm(llm)


async def bench_http(
    url: str,
    workload: Workload,
    levels: list[int],
    rounds: int,
    api_key: str | None = None,
    clients: int = 1,
    repeat: int = 1,
    server_cpu: CpuClock | None = None,
) -> list[dict]:
    async with load_client(url, max(levels)) as client:
        one = http_requester(client, workload, api_key)
        await run_level(one, workload.prompts(4), 4)  # warm-up: graphs, caches, connections
        if clients <= 1:
            in_process = functools.partial(run_level, one)
            return await _levels(in_process, workload, levels, rounds, repeat, server_cpu)
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=clients, mp_context=spawn) as pool:

        async def in_processes(prompts: list[list[int]], level: int) -> dict[str, Any]:
            return run_level_in_processes(pool, url, workload, prompts, level, clients, api_key)

        return await _levels(in_processes, workload, levels, rounds, repeat, server_cpu)


# Runs one level: (prompts, concurrency) -> its summary.
LevelRunner: TypeAlias = Callable[[list[list[int]], int], Awaitable[dict[str, Any]]]


async def _levels(
    run: LevelRunner,
    workload: Workload,
    levels: list[int],
    rounds: int,
    repeat: int = 1,
    serving_cpu: CpuClock | None = None,
) -> list[dict]:
    """Each level `repeat` times, the median run kept, with the serving process's CPU per token."""
    results = []
    for level in levels:
        prompts = workload.prompts(requests_per_level(level, rounds))
        runs = []
        for _ in range(repeat):
            before = serving_cpu() if serving_cpu else 0.0
            runs.append(_with_cpu(await run(prompts, level), serving_cpu, before))
        results.append(median_run(runs))
        print(_line(results[-1]), flush=True)
    return results


def process_cpu_s(pid: int) -> float:
    """CPU seconds so far of every live thread of `pid`, from the scheduler's nanosecond
    counters (/proc/<pid>/task/*/schedstat); /proc/<pid>/stat counts 10 ms ticks, too coarse for
    a level of a thousand tokens. A thread that exits between two readings takes its time with
    it; servers keep theirs for life."""
    total_ns = 0
    for schedstat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        with contextlib.suppress(OSError):  # the thread ended while we listed
            total_ns += int(schedstat.read_text().split()[0])
    return total_ns / 1e9


def _with_cpu(run: dict, clock: CpuClock | None, before: float) -> dict:
    if clock is not None and run["output_tokens"]:
        run["serving_cpu_ms_per_token"] = 1000 * (clock() - before) / run["output_tokens"]
    return run


MIN_REQUESTS_PER_LEVEL = 16  # low levels would otherwise time a handful of requests: noise


def requests_per_level(level: int, rounds: int) -> int:
    return max(level * rounds, MIN_REQUESTS_PER_LEVEL)


def median_run(runs: list[dict]) -> dict:
    """The run with the median throughput, carrying every run's throughput beside it: on a
    noisy machine one run per level says little."""
    ordered = sorted(runs, key=lambda run: run["output_tokens_per_s"])
    chosen = dict(ordered[len(ordered) // 2])
    chosen["runs_output_tokens_per_s"] = [run["output_tokens_per_s"] for run in runs]
    if all("serving_cpu_ms_per_token" in run for run in runs):
        chosen["runs_serving_cpu_ms_per_token"] = [run["serving_cpu_ms_per_token"] for run in runs]
    return chosen


def _line(level: dict) -> str:
    cpu = level.get("serving_cpu_ms_per_token")
    return (
        f"  c={level['concurrency']:>4}  {level['output_tokens_per_s']:>9.1f} tok/s  "
        f"TTFT p50 {level['ttft_s']['p50'] * 1000:7.1f} ms  ITL p50/p99 "
        f"{level['itl_s']['p50'] * 1000:.2f}/{level['itl_s']['p99'] * 1000:.2f} ms  "
        f"errors {level['errors']}" + (f"  serving CPU {cpu:.3f} ms/token" if cpu is not None else "")
    )


# --- servers as child processes ----------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def running_server(command: list[str], port: int, log: Path, env: dict[str, str]) -> Iterator[int]:
    """Start a server, wait for /health, yield its pid, and always stop it."""
    with log.open("wb") as out:
        # Its own process group (so the engine's children die with it) but NOT its own session:
        # with the kernel's autogroup scheduling (on by default) a new session is a new CPU
        # group, and inside it vLLM's spinning CPU-engine processes starve the API process,
        # which then sends whole responses at once (measured; see README, Performance).
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env, process_group=0
        )
        try:
            _wait_healthy(port, process, timeout_s=900)
            yield process.pid
        finally:
            _stop_group(process)


def _stop_group(process: subprocess.Popen) -> None:
    """SIGTERM the server's group, then SIGKILL whatever of it is left (an engine child can
    outlive a leader that exited)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, 15)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=60)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, 9)


def _wait_healthy(port: int, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} before it was healthy")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError("server did not become healthy in time")


def bundle_command(port: int) -> list[str]:
    return [sys.executable, "-m", "shared.serve", "--port", str(port)]


def vllm_server_command(settings: Settings, port: int) -> list[str]:
    from vllm.platforms import current_platform

    args = engine_args(settings, on_cpu=current_platform.is_cpu())
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model",
        args.model,
        "--served-model-name",
        settings.model_name,
        "--dtype",
        args.dtype,
        "--gpu-memory-utilization",
        str(args.gpu_memory_utilization),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--load-format",
        args.load_format,
        "--disable-log-stats",
        "--seed",
        str(settings.engine_seed),
        "--disable-uvicorn-access-log",
    ]
    if args.enforce_eager:
        command.append("--enforce-eager")
    if args.max_model_len:
        command += ["--max-model-len", str(args.max_model_len)]
    if args.max_num_batched_tokens:
        command += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    return command


def logged_batch_tokens(log: Path) -> int | None:
    """The prefill budget a server's engine resolved, from vLLM's own start-up log line: the
    proof that every target ran the same scheduler, whoever picked the default."""
    found = re.search(r"max_num_batched_tokens'?[=:] ?(\d+)", log.read_text(errors="replace"))
    return int(found.group(1)) if found else None


def peak_rss_mib(pid: int) -> float:
    """The process's resident-memory high-water mark (Linux), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


# --- the whole suite ---------------------------------------------------------------------------
def run_suite(args: argparse.Namespace) -> dict[str, Any]:
    settings = Settings()
    workload = Workload(args.prompt_tokens, args.output_tokens, args.vocab, model=settings.model_name)
    levels = [int(x) for x in args.levels.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "BUNDLE_MAX_IN_FLIGHT": str(max(10_000, args.capacity + 100)),
        "BUNDLE_LOG_LEVEL": "warning",
    }
    # Targets run in separate invocations (a GPU lease splits them) add up in one report.
    previous = out / "bench.json"
    results: dict[str, Any] = (
        orjson.loads(previous.read_bytes())["targets"] if args.merge and previous.exists() else {}
    )
    for target in args.targets.split(","):
        print(f"{target}:", flush=True)
        started = time.perf_counter()
        if target == "raw":
            raw_run = bench_raw(settings, workload, levels, args.rounds, args.repeat)
            results[target] = asyncio.run(raw_run)
        else:
            port = free_port()
            command = bundle_command(port) if target == "bundle" else vllm_server_command(settings, port)
            with running_server(command, port, out / f"{target}.log", env) as pid:
                url = f"http://127.0.0.1:{port}"
                levels_run = bench_http(
                    url,
                    workload,
                    levels,
                    args.rounds,
                    clients=args.clients,
                    repeat=args.repeat,
                    server_cpu=functools.partial(process_cpu_s, pid),
                )
                results[target] = {
                    "levels": asyncio.run(levels_run),
                    "client_processes": args.clients,
                    "max_num_batched_tokens": logged_batch_tokens(out / f"{target}.log"),
                }
                if target == "bundle" and args.capacity:
                    results[target]["capacity"] = asyncio.run(capacity(url, workload, args.capacity))
                    results[target]["capacity"]["server_peak_rss_mib"] = peak_rss_mib(pid)
        results[target]["seconds"] = time.perf_counter() - started
    report = {
        "schema": "bundle-bench/1",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": args.machine or f"{platform.node()} ({os.cpu_count()} CPUs, {platform.machine()})",
        "model": settings.model if not settings.uses_tiny_model else f"tiny:{settings.tiny_model_shape}",
        "workload": vars(workload),
        "targets": results,
    }
    (out / "bench.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    (out / "bench.md").write_text(markdown_table(report))
    with contextlib.suppress(ImportError):
        plot(report, out / "bench.png")
    print(markdown_table(report))
    return report


async def capacity(url: str, workload: Workload, streams: int) -> dict[str, Any]:
    """Hold `streams` streaming requests open at once; count failures and tail latency."""
    long = Workload(
        workload.prompt_tokens,
        workload.output_tokens * 2,
        workload.vocab_size,
        seed=7,
        model=workload.model,
    )
    async with load_client(url, streams, read_timeout_s=900.0, connect_timeout_s=60.0) as c:
        one = http_requester(c, long)
        started = time.perf_counter()
        samples = await asyncio.gather(*(one(p) for p in long.prompts(streams)))
        result = summarise(streams, list(samples), time.perf_counter() - started)
    print(
        f"capacity: {streams} streams, {result['errors']} failed, ITL p99 "
        f"{result['itl_s']['p99'] * 1000:.2f} ms",
        flush=True,
    )
    return result


def markdown_table(report: dict[str, Any]) -> str:
    targets = report["targets"]
    by_level = {t: {lv["concurrency"]: lv for lv in targets[t]["levels"]} for t in targets}
    levels = sorted({c for t in by_level.values() for c in t})
    names = [t for t in TARGETS if t in targets]
    head = (
        "| concurrency | "
        + " | ".join(f"{t}: tok/s · TTFT p50 ms · ITL p50/p99 ms" for t in names)
        + " | bundle/raw | bundle/vLLM server |"
    )
    rows = [head, "|" + "---|" * (len(names) + 3)]
    for level in levels:
        cells = [_cell(by_level[t].get(level)) for t in names]
        rows.append(
            f"| {level} | " + " | ".join(cells) + f" | {_ratio(by_level, level, 'raw')} | "
            f"{_ratio(by_level, level, 'vllm_server')} |"
        )
    rows += _cpu_table(by_level, names, levels)
    footer = [
        f"\n{report['machine']}; model {report['model']}; {report['date']}; workload "
        f"{report['workload']['prompt_tokens']} prompt tokens, "
        f"{report['workload']['output_tokens']} output tokens (ignore_eos), temperature 0."
    ]
    budgets = {t: targets[t].get("max_num_batched_tokens") for t in names}
    if any(budgets.values()):
        footer.append(
            "Engine prefill budget (max_num_batched_tokens): "
            + ", ".join(f"{t} {b if b is not None else 'not logged'}" for t, b in budgets.items())
            + "."
        )
    cap = targets.get("bundle", {}).get("capacity")
    if cap:
        footer.append(
            f"Capacity: {cap['concurrency']} concurrent streams through the bundle, "
            f"{cap['errors']} failed, ITL p99 {cap['itl_s']['p99'] * 1000:.1f} ms, "
            f"server peak RSS {cap.get('server_peak_rss_mib', 0):.0f} MiB."
        )
    return "\n".join(rows + footer) + "\n"


def _cpu_table(by_level: dict, names: list[str], levels: list[int]) -> list[str]:
    """CPU ms per output token of each target's serving process, where it was measured."""
    measured = [t for t in names if any("serving_cpu_ms_per_token" in lv for lv in by_level[t].values())]
    if not measured:
        return []
    rows = [
        "\nCPU time of the serving process per output token, ms (raw: the benchmark process itself):\n",
        "| concurrency | " + " | ".join(measured) + " |",
        "|" + "---|" * (len(measured) + 1),
    ]
    for level in levels:
        cells = [by_level[t].get(level, {}).get("serving_cpu_ms_per_token") for t in measured]
        rows.append(f"| {level} | " + " | ".join("-" if c is None else f"{c:.3f}" for c in cells) + " |")
    return rows


def _cell(level: dict | None) -> str:
    if level is None:
        return "-"
    return (
        f"{level['output_tokens_per_s']:,.0f} · {level['ttft_s']['p50'] * 1000:.1f} · "
        f"{level['itl_s']['p50'] * 1000:.1f}/{level['itl_s']['p99'] * 1000:.1f}"
    )


def _ratio(by_level: dict, level: int, other: str) -> str:
    mine, theirs = by_level.get("bundle", {}).get(level), by_level.get(other, {}).get(level)
    if not mine or not theirs or not theirs["output_tokens_per_s"]:
        return "-"
    return f"{mine['output_tokens_per_s'] / theirs['output_tokens_per_s']:.2f}"


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, target in report["targets"].items():
        xs = [lv["concurrency"] for lv in target["levels"]]
        left.plot(xs, [lv["output_tokens_per_s"] for lv in target["levels"]], marker="o", label=name)
        right.plot(xs, [lv["ttft_s"]["p50"] * 1000 for lv in target["levels"]], marker="o", label=name)
    for axis, label in ((left, "output tokens/s"), (right, "TTFT p50 (ms)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrent streams")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
        axis.legend()
    fig.suptitle(f"{report['model']} on {report['machine']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m shared.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("suite", "http"):
        p = sub.add_parser(name)
        p.add_argument("--levels", default="1,8,32,128", help="concurrency levels")
        p.add_argument("--rounds", type=int, default=2, help="requests per level = level x rounds, at least 16")
        p.add_argument("--prompt-tokens", type=int, default=128)
        p.add_argument("--output-tokens", type=int, default=64)
        p.add_argument("--vocab", type=int, default=1000, help="prompt ids are drawn below this")
        p.add_argument("--repeat", type=int, default=3, help="runs per level; the median run is reported")
        p.add_argument(
            "--clients",
            type=int,
            default=1 if (os.cpu_count() or 1) <= 4 else 4,
            help="client processes for HTTP targets (default: 4 on machines with >4 CPUs)",
        )
    suite = sub.choices["suite"]
    suite.add_argument("--out", default="bench/results")
    suite.add_argument("--targets", default=",".join(TARGETS))
    suite.add_argument("--capacity", type=int, default=1000, help="streams held open; 0: skip")
    suite.add_argument("--machine", default="", help="how to name the machine in the report")
    suite.add_argument("--merge", action="store_true", help="add to the targets in --out/bench.json")
    http = sub.choices["http"]
    http.add_argument("--url", required=True)
    http.add_argument("--model", default="tiny")
    http.add_argument("--api-key")
    args = parser.parse_args(argv)
    if args.command == "suite":
        run_suite(args)
        return
    workload = Workload(args.prompt_tokens, args.output_tokens, args.vocab, model=args.model)
    levels = [int(x) for x in args.levels.split(",")]
    asyncio.run(bench_http(args.url, workload, levels, args.rounds, args.api_key, args.clients, args.repeat))


if __name__ == "__main__":
    main()
