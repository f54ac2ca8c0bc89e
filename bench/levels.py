"""The level loop: every level `repeat` times, the median run kept with every run's figures
beside it, plus what the serving process spent (CPU per output token) and what vLLM's prefix
cache served. The same loop for in-process, single-client and multi-process targets: what
differs is the runner and the meters passed in."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeAlias

from bench.loadgen import cache_counts
from bench.workload import Workload

# CPU seconds used so far by the process that serves (the API process; for raw, the bench).
# CPU time per token is the serving layer's cost that survives a noisy machine: wall-clock
# figures on two shared cores move with whoever got the CPU, CPU seconds far less.
CpuClock: TypeAlias = Callable[[], float]
# The engine's prefix-cache counts so far: (prompt tokens looked up, tokens found).
CacheCounter: TypeAlias = Callable[[], tuple[int, int]]

# One of the server's own histograms so far: (sum of seconds, count).
HistogramCounter: TypeAlias = Callable[[], tuple[float, int]]

# Runs one level: (prompts, concurrency) -> its summary.
LevelRunner: TypeAlias = Callable[[list[list[int]], int], Awaitable[dict[str, Any]]]


@dataclass(frozen=True)
class Meters:
    """Readings taken around each run, for targets whose requests do not report them."""

    serving_cpu: CpuClock | None = None
    # CPU seconds so far by process role (bench/servers.py, server_cpu_by_role): "api" (and each
    # API process as "api.<i>"), "engine", "other"; reported per output token as `cpu_ms_per_token`.
    process_cpu: Callable[[], dict[str, float]] | None = None
    prefix_cache: CacheCounter | None = None
    # The bundle's TTFT from the start of its generation task; the client's mean minus this
    # is what the bundle adds before the engine is asked (HTTP, parsing, task queueing) plus
    # the first event's way out.
    server_ttft: HistogramCounter | None = None
    # The bundle's admission: from a request's first byte read to its generation admitted (on
    # Python 3.12 the engine has it by then). The part of the above that the server itself sees.
    server_admission: HistogramCounter | None = None
    # How late the bundle's event loop ran its 100 ms timer (shared/obs/loop_lag.py): a busy loop.
    server_loop_lag: HistogramCounter | None = None
    # The engine's step outputs in the API process (shared/obs/engine_outputs.py), raw and bundle
    # alike: how long they waited to be taken up, and how long handing them out took.
    engine_output_wait: HistogramCounter | None = None
    engine_output_handling: HistogramCounter | None = None
    # Server counters reported per output token (name -> value so far), e.g. the identity
    # store's round trips; divided by the tokens the clients counted, not the server's own.
    per_token: Callable[[], dict[str, float]] | None = None
    # How many of the bundle's loop-lag samples so far ran later than STALL_S: a mean hides one
    # long stall (a request burst missing an engine step), a count does not.
    server_loop_stalls: Callable[[], int] | None = None
    # The bundle's garbage-collection pauses so far (bundle_gc_pause_seconds): seconds in all,
    # and how many full collections and their seconds; reported per run as `server_gc`.
    server_gc: Callable[[], dict[str, float]] | None = None


NO_METERS = Meters()
STALL_S = 0.05  # a bucket bound of bundle_event_loop_lag_seconds


async def run_levels(
    run: LevelRunner,
    workload: Workload,
    levels: list[int],
    rounds: int,
    repeat: int = 1,
    meters: Meters = NO_METERS,
) -> list[dict]:
    """Each level `repeat` times on fresh prompts (see bench/workload.py), the median run kept."""
    results = []
    for level in levels:
        runs = []
        for attempt in range(repeat):
            prompts = workload.prompts(requests_per_level(level, rounds), f"c{level}/r{attempt}")
            runs.append(await _measured(run, prompts, level, meters))
        results.append(median_run(runs))
        print(_line(results[-1]), flush=True)
    return results


async def _measured(run: LevelRunner, prompts: list[list[int]], level: int, meters: Meters) -> dict:
    cpu_before = meters.serving_cpu() if meters.serving_cpu else 0.0
    roles_before = meters.process_cpu() if meters.process_cpu else {}
    cache_before = meters.prefix_cache() if meters.prefix_cache else (0, 0)
    histograms = {name: getattr(meters, meter) for name, meter in MEAN_METERS.items()}
    before = {name: (read, read()) for name, read in histograms.items() if read is not None}
    counted_before = meters.per_token() if meters.per_token else {}
    stalls_before = meters.server_loop_stalls() if meters.server_loop_stalls else 0
    gc_before = meters.server_gc() if meters.server_gc else {}
    result = await run(prompts, level)
    if meters.server_gc is not None:
        result["server_gc"] = {
            name: value - gc_before.get(name, 0.0) for name, value in meters.server_gc().items()
        }
    if meters.server_loop_stalls is not None:
        result["server_loop_stalls"] = meters.server_loop_stalls() - stalls_before
    if meters.per_token is not None:
        counted_after, tokens = meters.per_token(), result["output_tokens"]
        for name, value in counted_after.items():
            spent = value - counted_before.get(name, 0.0)
            result[f"{name}_per_token"] = spent / tokens if tokens else None
    if meters.serving_cpu is not None and result["output_tokens"]:
        result["serving_cpu_ms_per_token"] = (
            1000 * (meters.serving_cpu() - cpu_before) / result["output_tokens"]
        )
    if meters.process_cpu is not None and result["output_tokens"]:
        tokens, after = result["output_tokens"], meters.process_cpu()
        result["cpu_ms_per_token"] = {
            role: 1000 * (cpu - roles_before.get(role, 0.0)) / tokens for role, cpu in after.items()
        }
    if meters.prefix_cache is not None:
        queries, hits = meters.prefix_cache()
        result["prefix_cache"] = cache_counts(queries - cache_before[0], hits - cache_before[1])
    for name, (read, (seconds_before, count_before)) in before.items():
        seconds, count = read()
        if count > count_before:
            result[name] = (seconds - seconds_before) / (count - count_before)
    return result


MIN_REQUESTS_PER_LEVEL = 16  # low levels would otherwise time a handful of requests: noise


def requests_per_level(level: int, rounds: int) -> int:
    return max(level * rounds, MIN_REQUESTS_PER_LEVEL)


# Means some targets' runs carry, by the `Meters` field each is read from.
MEAN_METERS = {
    "server_ttft_mean_s": "server_ttft",
    "server_admission_mean_s": "server_admission",
    "server_loop_lag_mean_s": "server_loop_lag",
    "engine_output_wait_mean_s": "engine_output_wait",
    "engine_output_handling_mean_s": "engine_output_handling",
}
# Each kept per run beside the median run as `runs_<name>` (the server's TTFT goes there as
# what the client saw beyond it, `runs_ttft_added_by_server_s`).
# The load generator's own loop lag (bench/loadgen.py) rides along the same way.
OPTIONAL_MEANS = (
    *(name for name in MEAN_METERS if name != "server_ttft_mean_s"),
    "client_loop_lag_mean_s",
    "server_loop_stalls",  # a count, not a mean, kept per run the same way
)


def median_run(runs: list[dict]) -> dict:
    """The run with the median throughput, carrying every run's figures beside it: on a
    noisy machine one run per level says little."""
    # Every request's timeline, per run: for bench.timelines, which keeps them out of bench.json.
    timelines = [run.pop("timeline_ms", []) for run in runs]
    ordered = sorted(runs, key=lambda run: run["output_tokens_per_s"])
    chosen = dict(ordered[len(ordered) // 2])
    chosen["runs_timeline_ms"] = timelines
    chosen["runs_output_tokens_per_s"] = [run["output_tokens_per_s"] for run in runs]
    chosen["runs_ttft_p50_s"] = [run["ttft_s"]["p50"] for run in runs]
    for wave in ("first_wave", "later"):
        if all(f"ttft_{wave}_s" in run for run in runs):
            chosen[f"runs_ttft_{wave}_p50_s"] = [run[f"ttft_{wave}_s"]["p50"] for run in runs]
    if all("serving_cpu_ms_per_token" in run for run in runs):
        chosen["runs_serving_cpu_ms_per_token"] = [run["serving_cpu_ms_per_token"] for run in runs]
    if all("cpu_ms_per_token" in run for run in runs):
        chosen["runs_cpu_ms_per_token"] = [run["cpu_ms_per_token"] for run in runs]
    if all("server_ttft_mean_s" in run for run in runs):
        chosen["runs_ttft_added_by_server_s"] = [run["ttft_mean_s"] - run["server_ttft_mean_s"] for run in runs]
    for name in OPTIONAL_MEANS:
        if all(name in run for run in runs):
            chosen[f"runs_{name}"] = [run[name] for run in runs]
    if all("send_delay_s" in run for run in runs):
        chosen["runs_send_delay_p50_s"] = [run["send_delay_s"]["p50"] for run in runs]
    if all("prefix_cache" in run for run in runs):
        chosen["runs_prefix_cache_hit_rate"] = [run["prefix_cache"]["hit_rate"] for run in runs]
    return chosen


def _line(level: dict) -> str:
    cpu = level.get("serving_cpu_ms_per_token")
    cache = level.get("prefix_cache")
    return (
        f"  c={level['concurrency']:>4}  {level['output_tokens_per_s']:>9.1f} tok/s  "
        f"TTFT p50 {level['ttft_s']['p50'] * 1000:7.1f} ms  ITL p50/p99 "
        f"{level['itl_s']['p50'] * 1000:.2f}/{level['itl_s']['p99'] * 1000:.2f} ms  "
        f"errors {level['errors']}"
        + _waves(level)
        + (f"  serving CPU {cpu:.3f} ms/token" if cpu is not None else "")
        + (f"  prefix-cache hits {cache['hit_rate']:.1%}" if cache else "")
        + _ttft_split(level)
        + _engine_outputs(level)
        + _client_lag(level)
    )


def _client_lag(level: dict) -> str:
    lag, sent = level.get("client_loop_lag_mean_s"), level.get("send_delay_s")
    return ("" if lag is None else f"  client loop lag mean {lag * 1000:.1f} ms") + (
        "" if sent is None else f"  sent after due p50/p99 {sent['p50'] * 1000:.1f}/{sent['p99'] * 1000:.1f} ms"
    )


def _waves(level: dict) -> str:
    if "ttft_first_wave_s" not in level:
        return ""
    first, later = level["ttft_first_wave_s"]["p50"] * 1000, level["ttft_later_s"]["p50"] * 1000
    return f"  TTFT p50 first wave / later {first:.1f} / {later:.1f} ms"


def _ttft_split(level: dict) -> str:
    if "server_ttft_mean_s" not in level:
        return ""
    client, server = level["ttft_mean_s"] * 1000, level["server_ttft_mean_s"] * 1000
    extras = [
        f"{label} mean {level[name] * 1000:.1f} ms"
        for name, label in (("server_admission_mean_s", "admission"), ("server_loop_lag_mean_s", "loop lag"))
        if name in level
    ]
    if "server_loop_stalls" in level:
        extras.append(f"loop stalls over {STALL_S * 1000:.0f} ms {level['server_loop_stalls']}")
    if level.get("server_gc"):
        gc = level["server_gc"]
        extras.append(
            f"GC pauses {gc['gc_pause_s'] * 1000:.0f} ms "
            f"({gc['gc_full_collections']:.0f} full, {gc['gc_full_pause_s'] * 1000:.0f} ms)"
        )
    return f"  TTFT mean {client:.1f} ms, {server:.1f} of it after the generation task started" + "".join(
        f", {extra}" for extra in extras
    )


def _engine_outputs(level: dict) -> str:
    if "engine_output_wait_mean_s" not in level:
        return ""
    wait = level["engine_output_wait_mean_s"] * 1000
    handling = level.get("engine_output_handling_mean_s", 0.0) * 1000
    return f"  engine outputs: wait mean {wait:.2f} ms, handling mean {handling:.2f} ms"
