"""`python -m bench.takeover`: a replica SIGKILLed mid-generation, another continues every stream.

Two bundle servers (replicas A and B, each with `--memory` of the accelerator: they share one)
and a local valkey-server (BUNDLE_REDIS_URL, takeover on). `--streams` streams start on A, each
with its own X-Request-Id, a unique token-id prompt and `ignore_eos`, so every one must end with
exactly `--output-tokens`. Once every stream has at least `--kill-after` events (tokens), A's
whole process group is SIGKILLed, and each client resumes on B with its Last-Event-ID, as
`bundle_client` or a load balancer's retry would. Per stream: the time from the kill to its
first continued token (the first event after the last one A had logged, read from the store
right after the kill: events A logged that the client had not read yet come first, and are not
new), whether its events ran 1, 2, 3...
without a gap, and its completion token count (its usage, the whole generation's). The report
also keeps B's own takeover metrics. Exit status 1 unless every stream completed right.

    python -m bench.takeover --streams 8 --output-tokens 64 --kill-after 16   # CPU, tiny model
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import signal
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench.loadgen import percentiles
from bench.redis_overhead import local_store
from bench.servers import bundle_command, free_port, running_server
from bench.workload import Workload

TAKEOVER_METRICS = (
    "bundle_takeovers_total",
    "bundle_takeover_causes_total",
    "bundle_takeover_seconds",
    "bundle_continued_tokens_total",
)


@dataclass
class Stream:
    """One client's view of its generation, on A and then on B."""

    index: int
    ids: list[int] = field(default_factory=list)  # event ids seen, in order
    seen_at: list[float] = field(default_factory=list)  # monotonic time each of them arrived
    usage: dict[str, int] | None = None
    done: bool = False
    error: str | None = None
    logged_by_a: int = 0  # the last event A had written to the store when it was killed
    first_continued_at: float | None = None  # monotonic time of the first event B generated
    a_ended_at: float | None = None  # when its stream from A ended (A's socket closed by the kill)
    resumed_at: float | None = None  # when its resume was sent to B


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workload = Workload(args.prompt_tokens, args.output_tokens, args.vocab, seed=args.seed)
    prompts = workload.prompts(args.streams, "takeover")
    with local_store(args.redis_url, out) as redis_url:
        env = {**os.environ, "BUNDLE_REDIS_URL": redis_url, "BUNDLE_TAKEOVER": "true"}
        if args.memory is not None:
            env["BUNDLE_GPU_MEMORY_UTILIZATION"] = str(args.memory)
        # One after the other: each engine sizes its share while the other is idle.
        port_a, port_b = free_port(), free_port()
        with (
            running_server(
                bundle_command(port_a), port_a, out / "a.log", {**env, "BUNDLE_PORT": str(port_a)}
            ) as a,
            running_server(bundle_command(port_b), port_b, out / "b.log", {**env, "BUNDLE_PORT": str(port_b)}),
        ):
            urls = (f"http://127.0.0.1:{port_a}", f"http://127.0.0.1:{port_b}")
            args.redis = redis_url
            report = asyncio.run(_run(args, prompts, urls, a))
            report["b_metrics"] = _metrics(urls[1])
    report["machine"] = args.machine
    report["workload"] = {key: value for key, value in vars(args).items() if key != "redis"}
    (out / "takeover.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    print(
        orjson.dumps(
            {key: report[key] for key in ("streams", "kill_to_first_continued_s", "longest_stall_after_kill_s")}
        ).decode()
    )
    return 0 if report["streams"]["right"] == args.streams else 1


async def _run(
    args: argparse.Namespace, prompts: list[list[int]], urls: tuple[str, str], a_pid: int
) -> dict[str, Any]:
    streams = [Stream(index) for index in range(len(prompts))]
    killed = asyncio.Event()
    killed_at = 0.0
    limits = httpx.Limits(max_connections=2 * len(prompts))
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=300.0), limits=limits) as client:
        tasks = [
            asyncio.ensure_future(_stream(client, urls, prompt, stream, args, killed))
            for prompt, stream in zip(prompts, streams, strict=True)
        ]
        async with asyncio.timeout(args.timeout):
            while min(len(stream.ids) for stream in streams) < args.kill_after:
                if any(task.done() for task in tasks):  # a stream ended or failed before the kill
                    break
                await asyncio.sleep(0.01)
            at_kill = [len(stream.ids) for stream in streams]
            a_connection = await _a_connection(args.redis, args.seed)
            os.killpg(a_pid, signal.SIGKILL)  # the engine with it: a container that disappears
            killed_at = time.monotonic()
            connection_gone = asyncio.ensure_future(_gone_at(args.redis, a_connection))
            # Before any client asks B (only a client's request makes B look at the owner).
            await _logged_by_a(args.redis, streams, args.seed)
            killed.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            gone_at = await connection_gone
    report = _report(args, streams, at_kill, killed_at)
    # What the store saw: A's control connection left CLIENT LIST this long after the kill (the
    # earliest any replica can know A is dead), None where the store refuses CLIENT.
    report["kill_to_a_connection_gone_s"] = None if gone_at is None else gone_at - killed_at
    return report


async def _stream(
    client: httpx.AsyncClient,
    urls: tuple[str, str],
    prompt: list[int],
    stream: Stream,
    args: argparse.Namespace,
    killed: asyncio.Event,
) -> None:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": args.output_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"X-Request-Id": _request_id(args.seed, stream.index), "Accept": "text/event-stream"}
    with contextlib.suppress(httpx.HTTPError):  # A's connection is cut by the kill
        await _read(client, f"{urls[0]}/v1/completions", body, headers, stream, after_kill=False)
    stream.a_ended_at = time.monotonic()
    if stream.done:
        return  # finished before the kill (a kill-after too late for this length)
    await killed.wait()
    headers["Last-Event-ID"] = str(stream.ids[-1] if stream.ids else 0)
    stream.resumed_at = time.monotonic()
    try:
        await _read(client, f"{urls[1]}/v1/completions", body, headers, stream, after_kill=True)
    except httpx.HTTPError as exc:
        stream.error = f"{type(exc).__name__}: {exc}"


async def _read(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    stream: Stream,
    after_kill: bool,
) -> None:
    async with client.stream("POST", url, json=body, headers=headers) as response:
        if response.status_code != 200:
            stream.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
            return
        async for line in response.aiter_lines():
            if line.startswith("id: "):
                stream.ids.append(int(line[4:]))
                stream.seen_at.append(time.monotonic())
                if after_kill and stream.first_continued_at is None and stream.ids[-1] > stream.logged_by_a:
                    stream.first_continued_at = time.monotonic()
            elif line.startswith("data: "):
                _data(stream, line[6:])


async def _logged_by_a(redis_url: str, streams: list[Stream], seed: int) -> None:
    from shared.redis_client import redis_client

    client = redis_client(redis_url)
    try:
        async with client.pipeline(transaction=False) as pipe:
            for stream in streams:
                pipe.xrevrange(f"bundle:events:{_request_id(seed, stream.index)}", count=1)
            for stream, last in zip(streams, await pipe.execute(), strict=True):
                stream.logged_by_a = int(last[0][0].split(b"-")[0]) if last else 0
    finally:
        await client.aclose()


async def _a_connection(redis_url: str, seed: int) -> int | None:
    """The CLIENT ID of A's control connection: its heartbeat names it (`c:<id>`); A owns the
    first stream's claim."""
    from shared.redis_client import redis_client
    from shared.replicas.store import Claim
    from shared.replicas.store_keys import claim_key, replica_key

    client = redis_client(redis_url)
    try:
        raw = await client.get(claim_key(_request_id(seed, 0)))
        beat = await client.get(replica_key(Claim.decode(raw).owner)) if raw is not None else None
    finally:
        await client.aclose()
    text = beat.decode() if isinstance(beat, bytes) else beat
    return int(text[2:]) if text is not None and text.startswith("c:") else None


async def _gone_at(redis_url: str, client_id: int | None) -> float | None:
    """When `client_id` left the store's CLIENT LIST (polled every 5 ms, for at most 30 s)."""
    from shared.redis_client import redis_client

    if client_id is None:
        return None
    client = redis_client(redis_url)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if not await client.execute_command("CLIENT", "LIST", "ID", client_id):
                return time.monotonic()
            await asyncio.sleep(0.005)
        return None
    finally:
        await client.aclose()


def _request_id(seed: int, index: int) -> str:
    return f"takeover-{seed}-{index}"


def _data(stream: Stream, data: str) -> None:
    if data == "[DONE]":
        stream.done = True
        return
    chunk = orjson.loads(data)
    if "error" in chunk:
        stream.error = str(chunk["error"].get("code"))
    elif chunk.get("usage"):
        stream.usage = chunk["usage"]


def _report(
    args: argparse.Namespace, streams: list[Stream], at_kill: list[int], killed_at: float
) -> dict[str, Any]:
    def right(stream: Stream) -> bool:
        numbered = stream.ids == list(range(1, len(stream.ids) + 1))
        counted = stream.usage is not None and stream.usage["completion_tokens"] == args.output_tokens
        return stream.done and stream.error is None and numbered and counted

    waits = [s.first_continued_at - killed_at for s in streams if s.first_continued_at is not None]
    stalls = [_stall_after(stream, at_kill[stream.index]) for stream in streams]
    # A SIGKILLed process closes its sockets only once the kernel has torn it down: until then
    # neither its clients nor the store can tell it is gone.
    ended = [s.a_ended_at for s in streams if s.a_ended_at is not None]
    a_closed = [at - killed_at for at in ended if at >= killed_at]
    resumed = [s.resumed_at - killed_at for s in streams if s.resumed_at is not None]
    return {
        "schema": "bundle-takeover/1",
        "streams": {
            "total": len(streams),
            "right": sum(right(stream) for stream in streams),
            "completed": sum(stream.done and stream.error is None for stream in streams),
            "errors": sorted({stream.error for stream in streams if stream.error}),
            "token_counts": sorted({(s.usage or {}).get("completion_tokens", -1) for s in streams}),
            "events_read_at_kill": {
                "min": min(at_kill),
                "median": statistics.median(at_kill),
                "max": max(at_kill),
            },
        },
        "kill_to_first_continued_s": {
            **percentiles(waits),
            "max": max(waits, default=0.0),
            "count": len(waits),
        },
        # The longest wait between two events a client read, from its last event before the kill
        # to its end: what a reader feels of the takeover (the resume's round trip included).
        "longest_stall_after_kill_s": {**percentiles(stalls), "max": max(stalls, default=0.0)},
        "kill_to_a_stream_closed_s": {**percentiles(a_closed), "max": max(a_closed, default=0.0)},
        # Sent to B: A's stream closed and the benchmark read what A had logged (B's own part of
        # the takeover is the rest, in B's bundle_takeover_seconds).
        "kill_to_resume_sent_s": {**percentiles(resumed), "max": max(resumed, default=0.0)},
        "per_stream": [
            {
                "events": len(s.ids),
                "usage": s.usage,
                "error": s.error,
                "events_read_at_kill": at_kill[s.index],
                "events_logged_by_a": s.logged_by_a,
                "a_closed_after_kill_s": None if s.a_ended_at is None else s.a_ended_at - killed_at,
                "resumed_after_kill_s": None if s.resumed_at is None else s.resumed_at - killed_at,
            }
            for s in streams
        ],
    }


def _stall_after(stream: Stream, read_at_kill: int) -> float:
    times = stream.seen_at[max(read_at_kill - 1, 0) :]
    return max((later - earlier for earlier, later in zip(times, times[1:], strict=False)), default=0.0)


def _metrics(url: str) -> dict[str, float]:
    """B's takeover counters and the takeover time's sum and count, from its /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(TAKEOVER_METRICS) and not line.startswith(("bundle_takeover_seconds_bucket",)):
            name, value = line.rsplit(" ", 1)
            found[re.sub(r"\s+", "", name)] = float(value)
    return found


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.takeover", description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--kill-after", type=int, default=16, help="events every stream has before the kill")
    parser.add_argument("--vocab", type=int, default=1000, help="prompt ids are drawn below this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--memory", type=float, help="BUNDLE_GPU_MEMORY_UTILIZATION of each replica")
    parser.add_argument("--timeout", type=float, default=400, help="seconds the streams may take in all")
    parser.add_argument("--redis-url", help="use this server instead of starting a valkey-server")
    parser.add_argument("--machine", default="", help="how to name the machine in the report")
    parser.add_argument("--out", default="results/cpu/takeover")
    return parser


if __name__ == "__main__":
    raise SystemExit(main())
