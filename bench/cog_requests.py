"""Streaming requests for the Cog rehearsal (bench/cog_rehearsal.py): one Cog prediction over
SSE, or one chat completion from the bundle's HTTP server, as a `Sample`; plus the two checks
that only the Cog server needs (cancel mid-stream, one request_id twice).

Both targets get the same text prompt and `max_tokens`, and their output is counted the same
way (the streamed text encoded again with the model's tokenizer), so their figures compare.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench.loadgen import Requester, Sample

AT_CAPACITY = "HTTP 409"  # coglet 0.23.1: "At capacity - all prediction slots busy"

# The schema that `make cog-schema` writes, beside cog/ in the source tree (the runner's own
# modules are no package, `import cog` being the SDK): the rehearsal runs from the tree.
COG_SCHEMA = Path(__file__).resolve().parents[1] / ".cog" / "openapi_schema.json"


@functools.cache
def cog_input_defaults() -> dict[str, Any]:
    """The Cog inputs' defaults as coglet applies them, read on first use (not at import: the
    package imports from an installed wheel too, where no .cog/ folder exists)."""
    try:
        schema = orjson.loads(COG_SCHEMA.read_bytes())
    except FileNotFoundError:
        raise RuntimeError(f"{COG_SCHEMA} is missing: run the Cog rehearsal from the source tree") from None
    inputs = schema["components"]["schemas"]["Input"]["properties"]
    return {name: field["default"] for name, field in inputs.items() if "default" in field}


@dataclass
class Stream:
    """One stream as the client saw it; times in seconds from the send."""

    status: int = 0
    chunks: list[str] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    final: dict[str, Any] = field(default_factory=dict)  # Cog's `completed` event
    error: str = ""
    total_s: float = 0.0
    # The server's own count of output tokens when it gives one (the HTTP server's usage; Cog's
    # `output_token_count` metric where the runner reports it), else None: counted from text.
    tokens: int | None = None

    @property
    def text(self) -> str:
        return "".join(self.chunks)


async def cog_stream(
    client: aiohttp.ClientSession,
    inputs: dict[str, Any],
    prediction_id: str | None = None,
    on_chunk: Callable[[int], Any] | None = None,
) -> Stream:
    """POST (or PUT with an id) /predictions with `Accept: text/event-stream`."""
    method, path = ("PUT", f"/predictions/{prediction_id}") if prediction_id else ("POST", "/predictions")
    stream, started = Stream(), time.perf_counter()
    headers = {"Accept": "text/event-stream", "Content-Type": "application/json"}
    async with client.request(method, path, data=orjson.dumps({"input": inputs}), headers=headers) as r:
        stream.status = r.status
        if r.status != 200:
            stream.error = f"HTTP {r.status}: {(await r.read())[:160]!r}"
            return stream
        event = ""
        async for raw in r.content:
            line = raw.decode().rstrip("\r\n")
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                _cog_event(stream, event, orjson.loads(line[5:]), time.perf_counter() - started)
                if event == "output" and on_chunk is not None:
                    await on_chunk(len(stream.chunks))
    stream.total_s = time.perf_counter() - started
    return stream


def _cog_event(stream: Stream, event: str, data: Any, at: float) -> None:
    if event == "output":
        stream.chunks.append(data["chunk"])
        stream.arrivals.append(at)
    elif event in ("completed", "error"):
        stream.final = data if isinstance(data, dict) else {"data": data}
        counted = (stream.final.get("metrics") or {}).get("output_token_count")
        stream.tokens = int(counted) if counted is not None else None
        if event == "error" or stream.final.get("status") == "failed":
            stream.error = f"failed: {str(stream.final.get('error'))[:160]}"


async def chat_stream(client: aiohttp.ClientSession, model: str, prompt: str, max_tokens: int) -> Stream:
    """The same request as a chat completion from the bundle's HTTP server, streamed.

    With the Cog inputs' default top_p and top_k, which the Cog predictions get from coglet: the
    sampler then does the same work on both targets (on vLLM's GPU build, top-k/top-p masking is a
    Triton kernel of its own; without them the HTTP figures never ran it)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "top_p": cog_input_defaults()["top_p"],
        "top_k": cog_input_defaults()["top_k"],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    stream, started = Stream(), time.perf_counter()
    headers = {"Content-Type": "application/json"}
    async with client.post("/v1/chat/completions", data=orjson.dumps(body), headers=headers) as r:
        stream.status = r.status
        if r.status != 200:
            stream.error = f"HTTP {r.status}: {(await r.read())[:160]!r}"
            return stream
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            if usage := chunk.get("usage"):
                stream.tokens = int(usage["completion_tokens"])
            for choice in chunk.get("choices") or []:
                if text := (choice.get("delta") or {}).get("content"):
                    stream.chunks.append(text)
                    stream.arrivals.append(time.perf_counter() - started)
    stream.total_s = time.perf_counter() - started
    return stream


def as_sample(stream: Stream, count_tokens: Callable[[str], int]) -> Sample:
    if stream.error or not stream.arrivals:
        return Sample(ok=False, total_s=stream.total_s, error=stream.error or "the stream carried no text")
    gaps = [b - a for a, b in zip(stream.arrivals, stream.arrivals[1:], strict=False)]
    tokens = stream.tokens if stream.tokens is not None else count_tokens(stream.text)
    return Sample(True, stream.arrivals[0], stream.total_s, tokens, gaps)


def retrying_409(
    send: Callable[[str], Any], wait_s: float, retries: dict[str, int], tries: int = 20
) -> Callable[[str], Any]:
    """`send` again after `wait_s` while coglet answers 409 (the client advice in docs/cog.md);
    `retries["409"]` counts them. The stream's times stay counted from the first send."""

    async def send_until_accepted(text: str) -> Stream:
        started = time.perf_counter()
        for _ in range(tries):
            stream = await send(text)
            if stream.status != 409:
                break
            retries["409"] = retries.get("409", 0) + 1
            await asyncio.sleep(wait_s)
        late = time.perf_counter() - started - stream.total_s
        stream.arrivals = [at + late for at in stream.arrivals]
        stream.total_s += late
        return stream

    return send_until_accepted


def requester(
    send: Callable[[str], Any], to_text: Callable[[list[int]], str], count_tokens: Callable[[str], int]
) -> Requester:
    """A bench Requester (prompt ids -> Sample) over `send(text) -> Stream`."""

    async def one(prompt: list[int]) -> Sample:
        try:
            return as_sample(await send(to_text(prompt)), count_tokens)
        except (TimeoutError, aiohttp.ClientError) as exc:
            return Sample(ok=False, error=f"{type(exc).__name__}: {exc}"[:200])

    return one


async def engine_running(client: aiohttp.ClientSession) -> int:
    """vLLM's unfinished requests, as the runner reports it in a one-token prediction's metrics."""
    async with client.post("/predictions", json={"input": {"prompt": "ping", "max_tokens": 1}}) as r:
        answer = await r.json()
    return int(answer["metrics"]["engine_running_requests"])


async def cancel_mid_stream(
    client: aiohttp.ClientSession, inputs: dict[str, Any], after_chunks: int, settle_s: float = 10.0
) -> dict[str, Any]:
    """Cancel a long prediction after `after_chunks` outputs; then wait (up to `settle_s`) for
    the engine's running requests to reach 0."""
    prediction_id = uuid.uuid4().hex
    cancelled_at: list[float] = []
    before: list[int] = []

    async def maybe_cancel(chunks: int) -> None:
        if chunks == after_chunks and not cancelled_at:
            before.append(await engine_running(client))  # 1 here: the 0 after means something
            cancelled_at.append(time.perf_counter())
            async with client.post(f"/predictions/{prediction_id}/cancel") as r:
                await r.read()

    stream = await cog_stream(client, inputs, prediction_id, maybe_cancel)
    ended = time.perf_counter()
    running, deadline = await engine_running(client), ended + settle_s
    while running and time.perf_counter() < deadline:
        await asyncio.sleep(0.2)
        running = await engine_running(client)
    return {
        "chunks_before_cancel": after_chunks,
        "chunks_received": len(stream.chunks),
        "max_tokens": inputs["max_tokens"],
        "status": stream.final.get("status"),
        "engine_running_requests_before": before[0] if before else None,
        "stream_end_after_cancel_s": ended - cancelled_at[0] if cancelled_at else None,
        "engine_running_requests_after": running,
        "engine_idle_after_s": time.perf_counter() - ended if not running else None,
    }


async def same_request_id_twice(client: aiohttp.ClientSession, inputs: dict[str, Any]) -> dict[str, Any]:
    """Two predictions with one request_id at once: one generation, so identical text (at
    temperature 1 two generations would differ)."""
    tagged = {**inputs, "request_id": uuid.uuid4().hex}
    first, second = await asyncio.gather(cog_stream(client, tagged), cog_stream(client, tagged))
    return {
        "statuses": [first.final.get("status"), second.final.get("status")],
        "chunks": [len(first.chunks), len(second.chunks)],
        "identical_text": bool(first.text) and first.text == second.text,
    }
