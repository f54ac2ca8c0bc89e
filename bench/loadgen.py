"""Load generator: drive one level of concurrency and summarise what came back.

A level is a list of prompts sent with at most N requests in flight, through a requester (one
request -> its `Sample`) that knows the target: HTTP (`bench.requesters.http_requester`) or
vLLM's `AsyncLLM` in-process (`bench.requesters.engine_requester`, the floor no server can beat).
Per level it records time to first token, inter-token latency and end-to-end latency
(p50/p90/p99), output tokens per second, requests per second and errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from shared.obs.engine_outputs import Tally
from shared.obs.loop_lag import watch_loop_lag

# The load generator watches its own event loop too: a client process that falls behind its
# streams adds to every TTFT it measures, and that time is not the server's. (For raw it is the
# loop that also runs vLLM's output handler, as a server's is.)
CLIENT_LAG_INTERVAL_S = 0.02


@dataclass
class Sample:
    """One request's timeline (seconds from its start)."""

    ok: bool
    first_token_s: float = 0.0
    total_s: float = 0.0
    output_tokens: int = 0
    gaps_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    # Prompt tokens vLLM served from its prefix cache (its own per-request count,
    # `RequestOutput.num_cached_tokens`); None where the target does not report it.
    cached_tokens: int | None = None
    # Why it failed (status and the start of the body, or the exception): a benchmark that
    # counts errors must also say what they were.
    error: str = ""
    # Among the level's first `concurrency` requests, which all start at once (a burst); the
    # later ones start one by one as earlier ones finish. Their TTFTs differ in kind: a p50 over
    # both can sit between the two groups and jump from run to run.
    first_wave: bool = False
    # When it was due (see `gather_limited`), seconds from its level's start (its client
    # process's, for several); its first token and end are counted from then.
    started_s: float = 0.0
    # How long after it was due it was sent: the client's own delay, inside its TTFT.
    send_delay_s: float = 0.0


# One request: prompt token ids -> its timeline.
Requester: TypeAlias = Callable[[list[int]], Awaitable[Sample]]


def percentiles(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)}


def summarise(concurrency: int, samples: list[Sample], wall_s: float) -> dict[str, Any]:
    good = [s for s in samples if s.ok]
    tokens = sum(s.output_tokens for s in good)
    decode_rates = [
        (s.output_tokens - 1) / (s.total_s - s.first_token_s)
        for s in good
        if s.output_tokens > 1 and s.total_s > s.first_token_s
    ]
    return {
        "concurrency": concurrency,
        "requests": len(samples),
        "errors": len(samples) - len(good),
        "error_kinds": dict(Counter(s.error or "unknown" for s in samples if not s.ok).most_common(5)),
        "wall_s": wall_s,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall_s if wall_s else 0.0,
        "per_stream_tokens_per_s": statistics.median(decode_rates) if decode_rates else 0.0,
        "requests_per_s": len(good) / wall_s if wall_s else 0.0,
        "ttft_s": percentiles([s.first_token_s for s in good]),
        "ttft_mean_s": statistics.fmean(s.first_token_s for s in good) if good else 0.0,
        **_waves(good),
        "itl_s": percentiles([gap for s in good for gap in s.gaps_s]),
        "e2e_s": percentiles([s.total_s for s in good]),
        # The client's own share of those: how long after it was due each request was sent.
        "send_delay_s": percentiles([s.send_delay_s for s in samples]),
        **prefix_cache_summary(good),
        "timeline_ms": timeline_ms(samples),
    }


def _waves(good: list[Sample]) -> dict[str, Any]:
    """TTFT of the opening burst and of the later requests, apart (closed loop only: an open
    loop has no burst)."""
    if not any(s.first_wave for s in good):
        return {}
    return {
        "ttft_first_wave_s": percentiles([s.first_token_s for s in good if s.first_wave]),
        "ttft_later_s": percentiles([s.first_token_s for s in good if not s.first_wave]),
    }


def timeline_ms(samples: list[Sample]) -> list[list[float]]:
    """Every request as [due, first token, end, sent] in ms from the level's start (first token
    -1 for a failed one), in order of due time: what a percentile hides, e.g. which part of a
    burst a target is slower for. Kept out of bench.json (see bench.timelines)."""
    rows = [
        [
            round(s.started_s * 1000, 1),
            round((s.started_s + s.first_token_s) * 1000, 1) if s.ok else -1.0,
            round((s.started_s + s.total_s) * 1000, 1),
            round((s.started_s + s.send_delay_s) * 1000, 1),
        ]
        for s in samples
    ]
    return sorted(rows)


def prefix_cache_summary(samples: list[Sample]) -> dict[str, Any]:
    """{"prefix_cache": queries, hits, hit rate} from the samples, or {} if none reported it."""
    reported = [s for s in samples if s.cached_tokens is not None]
    if not reported:
        return {}
    return {
        "prefix_cache": cache_counts(
            sum(s.prompt_tokens for s in reported), sum(s.cached_tokens or 0 for s in reported)
        )
    }


def cache_counts(queries: int, hits: int) -> dict[str, Any]:
    """Prompt tokens looked up in the prefix cache, those found, and the share found."""
    return {"queries": queries, "hits": hits, "hit_rate": hits / queries if queries else 0.0}


def with_client_lag(level: dict[str, Any], lag: Tally) -> dict[str, Any]:
    """`level` with `client_loop_lag_mean_s` when there was a sample to average."""
    if lag.count:
        level["client_loop_lag_mean_s"] = lag.seconds / lag.count
    return level


@contextlib.asynccontextmanager
async def loop_lag_watched() -> AsyncIterator[Tally]:
    """How late this process's event loop runs while the block runs."""
    tally = Tally()
    watcher = asyncio.create_task(watch_loop_lag(tally, CLIENT_LAG_INTERVAL_S))
    try:
        yield tally
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


async def run_level(
    one_request: Requester,
    prompts: list[list[int]],
    concurrency: int,
    arrivals: list[float] | None = None,
    thinks: list[float] | None = None,
) -> dict[str, Any]:
    """Start all requests of a level with at most `concurrency` in flight (and, given
    `arrivals`, each no earlier than its offset from the level's start: an open loop)."""
    started = time.perf_counter()
    async with loop_lag_watched() as lag:
        samples = await gather_limited(one_request, prompts, concurrency, arrivals, thinks)
    return with_client_lag(summarise(concurrency, samples, time.perf_counter() - started), lag)


async def gather_limited(
    one_request: Requester,
    prompts: list[list[int]],
    concurrency: int,
    arrivals: list[float] | None = None,
    thinks: list[float] | None = None,
) -> list[Sample]:
    """`thinks`: how long each request keeps its place among the `concurrency` after it ends.

    Every request is timed from when it was due, not from when it was sent: from the moment its
    place among the `concurrency` came free (the level's start for the opening burst; an earlier
    request's end, plus its think time) or its arrival in an open loop, whichever is later. A
    client that is slow to send would otherwise leave its own delay out of every figure
    (coordinated omission). That matters for raw, whose requests are sent by the loop that
    also runs vLLM's output handler: at 256 streams it sent each ~20 ms after its place came
    free, time a server's clients spend waiting for its admission, which their TTFT counts.
    How late each request was sent is kept as its `send_delay_s`."""
    level_started = time.perf_counter()
    places: asyncio.Queue[float] = asyncio.Queue()  # when each free place came free
    for _ in range(concurrency):
        places.put_nowait(level_started)

    async def limited(prompt: list[int], due_s: float | None, think_s: float) -> Sample:
        if due_s is not None:
            await asyncio.sleep(due_s - (time.perf_counter() - level_started))
        freed_at = await places.get()  # first come, first served, as a semaphore's waiters
        due = max(freed_at, level_started + (due_s or 0.0))
        sent = time.perf_counter()
        try:
            sample = await one_request(prompt)
        except BaseException:
            places.put_nowait(time.perf_counter())
            raise
        ended = time.perf_counter()
        if think_s:
            await asyncio.sleep(think_s)
        places.put_nowait(ended + think_s)
        return from_due(sample, due - level_started, sent - due)

    offsets: list[float | None] = list(arrivals) if arrivals is not None else [None] * len(prompts)
    waits = thinks if thinks is not None else [0.0] * len(prompts)
    started = (limited(p, at, wait) for p, at, wait in zip(prompts, offsets, waits, strict=True))
    samples = list(await asyncio.gather(*started))
    if arrivals is None:  # a closed loop opens with a burst
        for sample in samples[:concurrency]:
            sample.first_wave = True
    return samples


def from_due(sample: Sample, due_s: float, send_delay_s: float) -> Sample:
    """`sample` (timed by its requester from the send) timed from when it was due instead."""
    sample.started_s = due_s
    sample.send_delay_s = send_delay_s
    sample.total_s += send_delay_s
    if sample.ok:
        sample.first_token_s += send_delay_s
    return sample
