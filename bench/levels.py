"""The level loop: every level `repeat` times, the median run kept, with the serving process's
CPU per output token. The same loop for in-process, single-client and multi-process targets:
what differs is the runner passed in."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeAlias

from bench.workload import Workload

# CPU seconds used so far by the process that serves (the API process; for raw, the bench).
# CPU time per token is the serving layer's cost that survives a noisy machine: wall-clock
# figures on two shared cores move with whoever got the CPU, CPU seconds far less.
CpuClock: TypeAlias = Callable[[], float]

# Runs one level: (prompts, concurrency) -> its summary.
LevelRunner: TypeAlias = Callable[[list[list[int]], int], Awaitable[dict[str, Any]]]


async def run_levels(
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
