"""Requesters: one request to a target -> its `Sample`, over HTTP + SSE or straight into
vLLM's `AsyncLLM`. The HTTP side does as little work per event as it can (it splits events and
reads only the final usage chunk), so the numbers measure the server, not the client.

The HTTP client is aiohttp, as in vLLM's own `vllm bench serve`: under a burst of streams it
spends several times less CPU per request than httpx (measured here: 128 one-token requests
at once, ~0.5 vs ~3 ms of client CPU each), CPU that would otherwise be counted in every HTTP
target's time to first token and not in the in-process raw engine's.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from typing import Any

import aiohttp
import orjson

from bench.loadgen import Requester, Sample
from bench.workload import Workload

COMPLETIONS = "/v1/completions"


def load_client(
    url: str, read_timeout_s: float = 600.0, connect_timeout_s: float = 30.0
) -> aiohttp.ClientSession:
    """An HTTP client for load: no connection cap, every idle connection kept for reuse, long
    reads (unlike httpx's pool, aiohttp's needs no size for the concurrency it will serve)."""
    connector = aiohttp.TCPConnector(limit=0, force_close=False, keepalive_timeout=600)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s)
    return aiohttp.ClientSession(base_url=url, connector=connector, timeout=timeout)


async def open_connections(client: aiohttp.ClientSession, count: int, api_key: str | None = None) -> None:
    """Open `count` connections before the clock starts: TCP set-up is not the server's time
    to first token. (Concurrent requests, each on its own connection, all left idle for reuse.)"""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def touch() -> None:
        async with client.get("/v1/models", headers=headers) as response:
            await response.read()

    await asyncio.gather(*(touch() for _ in range(count)))


# --- over HTTP ----------------------------------------------------------------------------------
def http_requester(
    client: aiohttp.ClientSession, workload: Workload, api_key: str | None = None, *, request_ids: bool = False
) -> Requester:
    """`request_ids`: each request gets its own X-Request-Id (bench/redis_overhead.py)."""
    shared_headers = {"Content-Type": "application/json"}
    if api_key:
        shared_headers["Authorization"] = f"Bearer {api_key}"
    models = itertools.cycle(workload.models or (workload.model,))  # spread evenly over them

    async def one(prompt: list[int]) -> Sample:
        headers = {**shared_headers, "X-Request-Id": uuid.uuid4().hex} if request_ids else shared_headers
        body = orjson.dumps(
            {
                "model": next(models),
                "prompt": prompt,
                "max_tokens": workload.output_length(prompt),
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        )
        started = time.perf_counter()
        arrivals: list[float] = []
        usage: dict[str, Any] = {}
        try:
            async with client.post(COMPLETIONS, data=body, headers=headers) as r:
                if r.status != 200:
                    answer = await r.read()
                    return Sample(ok=False, error=f"HTTP {r.status}: {answer[:160]!r}")
                buffer = b""
                async for piece in r.content.iter_any():
                    now = time.perf_counter()
                    buffer += piece
                    *events, buffer = buffer.split(b"\n\n")
                    carried_text = False
                    for event in events:
                        carried_text |= _read_event(event, usage)
                    # One arrival per read that brought text: tokens that reach the client in
                    # one read arrive together, whatever the number of events.
                    if carried_text:
                        arrivals.append(now - started)
        except (TimeoutError, aiohttp.ClientError) as exc:
            return Sample(ok=False, error=f"{type(exc).__name__}: {exc}"[:200])
        sample = _sample(arrivals, time.perf_counter() - started, usage.get("completion_tokens", 0))
        sample.prompt_tokens = usage.get("prompt_tokens", len(prompt))
        # vLLM's server reports it with --enable-prompt-tokens-details; the bundle does not.
        sample.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        return sample

    return one


def _read_event(event: bytes, usage: dict[str, Any]) -> bool:
    """Whether this event carries text; the final usage chunk is copied into `usage`."""
    data = event[event.find(b"data: ") + 6 :]
    if data == b"[DONE]" or not data:
        return False
    if b'"usage":{' in data and b'"choices":[]' in data:
        usage.update(orjson.loads(data)["usage"])
        return False
    return b'"text":""' not in data


def _sample(arrivals: list[float], total: float, tokens: int) -> Sample:
    if not arrivals:
        return Sample(ok=False, total_s=total, error="the stream carried no text")
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return Sample(True, arrivals[0], total, tokens or len(arrivals), gaps)


# --- in-process, straight into AsyncLLM -----------------------------------------------------
def engine_requester(llm: Any, workload: Workload) -> Requester:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params: dict[int, Any] = {}  # by output length: one SamplingParams each, as the body of an HTTP request

    def params_for(length: int) -> Any:
        if length not in params:
            params[length] = SamplingParams(
                max_tokens=length, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA
            )
        return params[length]

    counter = iter(range(1 << 62))

    async def one(prompt: list[int]) -> Sample:
        started = time.perf_counter()
        arrivals: list[float] = []
        tokens = 0
        cached: int | None = None
        try:
            request = {"prompt_token_ids": prompt}
            length = workload.output_length(prompt)
            async for output in llm.generate(request, params_for(length), f"raw-{next(counter)}"):
                new = len(output.outputs[0].token_ids)
                if new:
                    arrivals.append(time.perf_counter() - started)
                    tokens += new
                cached = output.num_cached_tokens if cached is None else cached
        except Exception as exc:
            return Sample(ok=False, error=f"{type(exc).__name__}: {exc}"[:200])
        sample = _sample(arrivals, time.perf_counter() - started, tokens)
        sample.prompt_tokens, sample.cached_tokens = len(prompt), cached or 0
        return sample

    return one
