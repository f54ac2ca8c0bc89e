"""Load generator: the same fixed requests against any OpenAI-compatible server, or straight
into vLLM's `AsyncLLM` in-process (the floor no server can beat).

Per concurrency level it records time to first token, inter-token latency and end-to-end
latency (p50/p90/p99), output tokens per second, requests per second and errors. The client
does as little work per event as it can (it splits events and reads only the final usage
chunk), so the numbers measure the server, not the client.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson


@dataclass(frozen=True)
class Workload:
    prompt_tokens: int = 128
    output_tokens: int = 64
    vocab_size: int = 1000
    seed: int = 0
    model: str = "tiny"

    def prompts(self, count: int) -> list[list[int]]:
        """Fixed token-id prompts (the same for every target); ids avoid the special tokens."""
        rng = random.Random(self.seed)
        low = min(16, self.vocab_size - 1)
        return [[rng.randrange(low, self.vocab_size) for _ in range(self.prompt_tokens)] for _ in range(count)]


@dataclass
class Sample:
    """One request's timeline (seconds from its start)."""

    ok: bool
    first_token_s: float = 0.0
    total_s: float = 0.0
    output_tokens: int = 0
    gaps_s: list[float] = field(default_factory=list)


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
        "wall_s": wall_s,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall_s if wall_s else 0.0,
        "per_stream_tokens_per_s": statistics.median(decode_rates) if decode_rates else 0.0,
        "requests_per_s": len(good) / wall_s if wall_s else 0.0,
        "ttft_s": percentiles([s.first_token_s for s in good]),
        "itl_s": percentiles([gap for s in good for gap in s.gaps_s]),
        "e2e_s": percentiles([s.total_s for s in good]),
    }


async def run_level(
    one_request: Callable[[list[int]], Awaitable[Sample]],
    prompts: list[list[int]],
    concurrency: int,
) -> dict[str, Any]:
    """Start all requests of a level with at most `concurrency` in flight."""
    started = time.perf_counter()
    samples = await _gather_limited(one_request, prompts, concurrency)
    return summarise(concurrency, samples, time.perf_counter() - started)


async def _gather_limited(
    one_request: Callable[[list[int]], Awaitable[Sample]],
    prompts: list[list[int]],
    concurrency: int,
) -> list[Sample]:
    gate = asyncio.Semaphore(concurrency)

    async def limited(prompt: list[int]) -> Sample:
        async with gate:
            return await one_request(prompt)

    return list(await asyncio.gather(*(limited(p) for p in prompts)))


def load_client(
    url: str, connections: int, read_timeout_s: float = 600.0, connect_timeout_s: float = 30.0
) -> httpx.AsyncClient:
    """An HTTP client for load: no connection cap, `connections` kept alive, long reads."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=connections)
    return httpx.AsyncClient(
        base_url=url, limits=limits, timeout=httpx.Timeout(connect_timeout_s, read=read_timeout_s)
    )


# --- over HTTP ----------------------------------------------------------------------------------
def http_requester(
    client: httpx.AsyncClient, workload: Workload, api_key: str | None = None
) -> Callable[[list[int]], Awaitable[Sample]]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def one(prompt: list[int]) -> Sample:
        body = {
            "model": workload.model,
            "prompt": prompt,
            "max_tokens": workload.output_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        started = time.perf_counter()
        arrivals: list[float] = []
        usage_tokens = 0
        try:
            async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
                if r.status_code != 200:
                    await r.aread()
                    return Sample(ok=False)
                buffer = b""
                async for piece in r.aiter_raw():
                    now = time.perf_counter()
                    buffer += piece
                    *events, buffer = buffer.split(b"\n\n")
                    carried_text = False
                    for event in events:
                        usage_tokens, has_text = _read_event(event, usage_tokens)
                        carried_text |= has_text
                    # One arrival per read that brought text: tokens that reach the client in
                    # one read arrive together, whatever the number of events.
                    if carried_text:
                        arrivals.append(now - started)
        except httpx.HTTPError:
            return Sample(ok=False)
        return _sample(arrivals, time.perf_counter() - started, usage_tokens)

    return one


def _read_event(event: bytes, usage_tokens: int) -> tuple[int, bool]:
    """(completion tokens reported so far, whether this event carries text)."""
    data = event[event.find(b"data: ") + 6 :]
    if data == b"[DONE]" or not data:
        return usage_tokens, False
    if b'"usage":{' in data and b'"choices":[]' in data:
        return int(orjson.loads(data)["usage"]["completion_tokens"]), False
    return usage_tokens, b'"text":""' not in data


def _sample(arrivals: list[float], total: float, tokens: int) -> Sample:
    if not arrivals:
        return Sample(ok=False, total_s=total)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return Sample(True, arrivals[0], total, tokens or len(arrivals), gaps)


# --- in-process, straight into AsyncLLM -----------------------------------------------------
def engine_requester(llm: Any, workload: Workload) -> Callable[[list[int]], Awaitable[Sample]]:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(
        max_tokens=workload.output_tokens,
        temperature=0.0,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
    )
    counter = iter(range(1 << 62))

    async def one(prompt: list[int]) -> Sample:
        started = time.perf_counter()
        arrivals: list[float] = []
        tokens = 0
        try:
            async for output in llm.generate({"prompt_token_ids": prompt}, params, f"raw-{next(counter)}"):
                new = len(output.outputs[0].token_ids)
                if new:
                    arrivals.append(time.perf_counter() - started)
                    tokens += new
        except Exception:
            return Sample(ok=False)
        return _sample(arrivals, time.perf_counter() - started, tokens)

    return one


# --- over HTTP from several client processes ------------------------------------------------
# One Python client parsing ~10k events/s is itself near saturation; at high concurrency the
# load is split over processes so that the numbers describe the server, not the client.
def run_level_in_processes(
    pool: Any,
    url: str,
    workload: Workload,
    prompts: list[list[int]],
    concurrency: int,
    clients: int,
    api_key: str | None = None,
) -> dict[str, Any]:
    clients = max(1, min(clients, concurrency))
    start_at = time.time() + 3.0  # every process starts its share at the same instant
    futures = [
        pool.submit(
            _client_process,
            url,
            workload,
            prompts[i::clients],
            -(-concurrency // clients),
            start_at,
            api_key,
        )
        for i in range(clients)
    ]
    parts = [future.result() for future in futures]
    samples = [Sample(**fields) for rows, _ in parts for fields in rows]
    wall = max(end for _, end in parts) - start_at
    return summarise(concurrency, samples, wall)


def _client_process(
    url: str,
    workload: Workload,
    prompts: list[list[int]],
    concurrency: int,
    start_at: float,
    api_key: str | None,
) -> tuple[list[dict[str, Any]], float]:
    return asyncio.run(_client_share(url, workload, prompts, concurrency, start_at, api_key))


async def _client_share(
    url: str,
    workload: Workload,
    prompts: list[list[int]],
    concurrency: int,
    start_at: float,
    api_key: str | None,
) -> tuple[list[dict[str, Any]], float]:
    from dataclasses import asdict

    async with load_client(url, concurrency) as client:
        one = http_requester(client, workload, api_key)
        # Open the connections before the clock starts, as the single-process path's warm-up
        # does: TCP set-up is not the server's time to first token.
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        await asyncio.gather(*(client.get("/v1/models", headers=headers) for _ in range(concurrency)))
        await asyncio.sleep(max(0.0, start_at - time.time()))
        samples = await _gather_limited(one, prompts, concurrency)
        end = time.time()
    return [asdict(s) for s in samples], end
