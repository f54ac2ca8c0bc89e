"""`python -m bench suite`: the bundle against raw AsyncLLM and vLLM's own server, one after
another on the same engine settings and identical requests, so ratios hold on a noisy box."""

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

from bench.loadgen import summarise
from bench.plot import plot
from bench.report import markdown_table
from bench.requesters import http_requester, load_client
from bench.servers import (
    bundle_command,
    free_port,
    logged_batch_tokens,
    peak_rss_mib,
    process_cpu_s,
    running_server,
    vllm_server_command,
)
from bench.targets import bench_http, bench_raw
from bench.workload import Workload
from shared.settings import Settings


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
