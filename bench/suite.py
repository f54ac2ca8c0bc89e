"""`python -m bench suite`: the bundle against raw AsyncLLM and vLLM's own server, one after
another on the same engine flags and identical requests, so ratios hold on a noisy box.

Each target is run with each prefix-caching mode asked for (`--prefix-caching on,off`), the
flag passed explicitly to every target; the JSON holds every run of every level."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import functools
import os
import platform
import time
from pathlib import Path
from typing import Any

import orjson

from bench import timelines
from bench.levels import STALL_S, Meters
from bench.loadgen import summarise
from bench.plot import plot
from bench.report import markdown_table
from bench.requesters import http_requester, load_client
from bench.servers import (
    bundle_command,
    free_port,
    logged_batch_tokens,
    metrics_gc_pauses,
    metrics_histogram_above,
    metrics_histogram_counter,
    peak_rss_mib,
    running_server,
    server_cpu_by_role,
    stats_file_counter,
    vllm_defaults_command,
    vllm_server_command,
)
from bench.specs import TargetSpec
from bench.targets import bench_http, bench_raw, import_engine
from bench.workload import Workload
from shared.settings import Settings


def run_suite(args: argparse.Namespace) -> dict[str, Any]:
    import_engine()  # before any engine exists: see its docstring
    specs = [TargetSpec.parse(name) for name in args.targets.split(",")]
    settings = Settings()
    workload = Workload(
        args.prompt_tokens,
        args.output_tokens,
        args.vocab,
        seed=args.seed,
        model=settings.model_name,
        shared_prefix_tokens=args.shared_prefix_tokens,
        request_rate=args.request_rate,
        think_s=args.think_time,
        think_random=args.think_random,
        output_spread=args.output_spread,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    for spec in specs:
        for caching in args.prefix_caching:
            name = spec.result_name(caching)
            print(f"{name}:", flush=True)
            started = time.perf_counter()
            results[name] = run_target(spec, caching, workload, args, out)
            results[name]["seconds"] = time.perf_counter() - started
    timelines.write(out, timelines.split_off(results), merge=args.merge)
    report = {
        "schema": "bundle-bench/2",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": args.machine or f"{platform.node()} ({os.cpu_count()} CPUs, {platform.machine()})",
        "model": settings.model if not settings.uses_tiny_model else f"tiny:{settings.tiny_model_shape}",
        "workload": vars(workload),
        "repeat": args.repeat,
        "rounds": args.rounds,
        "timed_from": TIMED_FROM,
        # Targets run in separate invocations (a GPU lease splits them) add up in one report,
        # read when this one ends: a run beside it on another GPU may have written meanwhile.
        "targets": {**(previous_targets(out / "bench.json") if args.merge else {}), **results},
    }
    write_report(report, out)
    print(markdown_table(report))
    return report


def write_report(report: dict[str, Any], out: Path) -> None:
    """bench.json, and the table and chart made from it."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    (out / "bench.md").write_text(markdown_table(report))
    with contextlib.suppress(ImportError):
        plot(report, out / "bench.png")


# How a report's requests were timed: from when each was due (bench.loadgen.gather_limited).
# Reports from before that timed them from the send and do not say.
TIMED_FROM = "due"


def timed_from(report: dict[str, Any]) -> str:
    return report.get("timed_from", "send")


def previous_targets(report: Path) -> dict[str, Any]:
    return orjson.loads(report.read_bytes())["targets"] if report.exists() else {}


def merge_refusal(out: Path) -> str | None:
    """Why a run cannot be merged into the report in `out`, or None if it can (or none is there)."""
    path = out / "bench.json"
    if path.exists() and timed_from(orjson.loads(path.read_bytes())) != TIMED_FROM:
        return f"{path} timed its requests from the send, this run from when each was due; use another --out"
    return None


def merge_reports(paths: list[Path]) -> dict[str, Any]:
    """One report from several runs of the same workload (e.g. one per GPU of a pair): every
    target, a later file's winning where two have the same one; the newest date."""
    reports = [orjson.loads(path.read_bytes()) for path in paths]
    # A report from before a workload field existed ran that field's default.
    defaults = vars(Workload())
    runs = [
        [{**defaults, **report["workload"]}, report.get("rounds"), timed_from(report)] for report in reports
    ]
    workloads = {orjson.dumps(run, option=orjson.OPT_SORT_KEYS) for run in runs}
    if len(workloads) > 1:
        raise ValueError(
            "these reports ran different workloads or timed them differently: they cannot share a table"
        )
    merged = {**reports[0], "date": max(report["date"] for report in reports), "targets": {}}
    for report in reports:
        merged["targets"].update(report["targets"])
    return merged


def run_target(
    spec: TargetSpec, caching: bool, workload: Workload, args: argparse.Namespace, out: Path
) -> dict[str, Any]:
    if spec.kind == "raw":
        levels = [int(x) for x in args.levels.split(",")]
        result = asyncio.run(bench_raw(spec.settings(caching), workload, levels, args.rounds, args.repeat))
        return {**result, "prefix_caching": caching}
    stats = out / f"{_file_stem(spec, caching)}.stats.json"
    try:
        return run_server(spec, caching, workload, args, out, stats)
    finally:
        for scratch in [stats, *stats.parent.glob(f"{stats.stem}.[0-9]*{stats.suffix}")]:
            scratch.unlink(missing_ok=True)  # the counts are in the report


def run_server(
    spec: TargetSpec, caching: bool, workload: Workload, args: argparse.Namespace, out: Path, stats: Path
) -> dict[str, Any]:
    """Start the target's server, measure every level through it, always stop it."""
    port = free_port()
    log = out / f"{_file_stem(spec, caching)}.log"
    env = {
        **os.environ,
        **spec.server_env(caching),
        "BUNDLE_MAX_IN_FLIGHT": str(max(10_000, args.capacity + 100)),
        "BUNDLE_LOG_LEVEL": "warning",
        "BUNDLE_ENGINE_STATS_FILE": str(stats),  # the bundle's prefix-cache counts (bench only)
    }
    bundle = spec.kind == "bundle"
    with running_server(server_command(spec, caching, port), port, log, env) as pid:
        url = f"http://127.0.0.1:{port}"
        histogram = functools.partial(metrics_histogram_counter, url)
        by_role = server_cpu_by_role(pid)
        meters = Meters(
            serving_cpu=lambda: by_role()["api"],  # the API processes together (one: the server)
            process_cpu=by_role,
            prefix_cache=stats_file_counter(stats) if bundle else None,
            server_ttft=histogram("bundle_time_to_first_token_seconds") if bundle else None,
            server_admission=histogram("bundle_admission_seconds") if bundle else None,
            server_loop_lag=histogram("bundle_event_loop_lag_seconds") if bundle else None,
            engine_output_wait=histogram("bundle_engine_output_wait_seconds") if bundle else None,
            engine_output_handling=histogram("bundle_engine_output_handling_seconds") if bundle else None,
            server_loop_stalls=(
                metrics_histogram_above(url, "bundle_event_loop_lag_seconds", STALL_S) if bundle else None
            ),
            server_gc=metrics_gc_pauses(url) if bundle else None,
        )
        levels = [int(x) for x in args.levels.split(",")]
        run = bench_http(
            url, workload, levels, args.rounds, clients=args.clients, repeat=args.repeat, meters=meters
        )
        result: dict[str, Any] = {
            "levels": asyncio.run(run),
            "client_processes": args.clients,
            "max_num_batched_tokens": logged_batch_tokens(log),
            "prefix_caching": None if spec.vllm_defaults else caching,
        }
        if spec.name == "bundle" and args.capacity:
            result["capacity"] = asyncio.run(capacity(url, workload, args.capacity))
            result["capacity"]["server_peak_rss_mib"] = peak_rss_mib(pid)
    return result


def server_command(spec: TargetSpec, caching: bool, port: int) -> list[str]:
    if spec.kind == "bundle":
        return bundle_command(port)  # its settings travel in the environment (spec.server_env)
    if spec.vllm_defaults:
        return vllm_defaults_command(spec.settings(caching), port)
    return vllm_server_command(spec.settings(caching), port, api_servers=spec.processes)


def _file_stem(spec: TargetSpec, caching: bool) -> str:
    return spec.result_name(caching).replace(":", "-").replace("/", "-")


async def capacity(url: str, workload: Workload, streams: int) -> dict[str, Any]:
    """Hold `streams` streaming requests open at once; count failures and tail latency."""
    long = Workload(
        workload.prompt_tokens,
        workload.output_tokens * 2,
        workload.vocab_size,
        seed=workload.seed,
        model=workload.model,
    )
    async with load_client(url, read_timeout_s=900.0, connect_timeout_s=60.0) as c:
        one = http_requester(c, long)
        started = time.perf_counter()
        samples = await asyncio.gather(*(one(p) for p in long.prompts(streams, "capacity")))
        result = summarise(streams, list(samples), time.perf_counter() - started)
        result.pop("timeline_ms")  # one burst: its summary says it all
    print(
        f"capacity: {streams} streams, {result['errors']} failed, ITL p99 "
        f"{result['itl_s']['p99'] * 1000:.2f} ms",
        flush=True,
    )
    return result
