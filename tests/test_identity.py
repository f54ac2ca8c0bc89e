"""Request identity on the real engine: de-duplication, resume, disconnect grace, cancel,
bounded memory, and the resumable client."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest

from bundle_client.client import ResumableClient, ResumeUnsupported, StreamGone
from shared.service import Service
from tests.conftest import LiveServers, long_chat
from tests.gate import Gate, Hold
from tests.test_api import sse_events


def texts_of(raw: bytes) -> str:
    """Concatenated delta text of a raw SSE body (chat chunks)."""
    pieces = []
    for _, data in sse_events(raw):
        if data == b"[DONE]":
            continue
        chunk = orjson.loads(data)
        for choice in chunk.get("choices", []):
            pieces.append(choice["delta"].get("content") or "")
    return "".join(pieces)


def sampled_chat(max_tokens: int = 64) -> dict[str, Any]:
    # temperature 1 and no seed: two independent generations would (almost surely) differ.
    return long_chat(max_tokens=max_tokens, temperature=1.0)


async def test_twenty_duplicates_share_one_generation(base_url: str, service: Service) -> None:
    before = service.metrics.engine_generations._value.get()
    headers = {"X-Request-Id": "dup-twenty"}
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        responses = await asyncio.gather(
            *(client.post("/v1/chat/completions", json=sampled_chat(), headers=headers) for _ in range(20))
        )
    assert service.metrics.engine_generations._value.get() - before == 1
    bodies = {r.content for r in responses}
    assert len(bodies) == 1 and texts_of(bodies.pop())
    assert all(r.headers["x-request-id"] == "dup-twenty" for r in responses)


async def test_a_finished_result_is_replayed_not_regenerated(base_url: str, service: Service) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 16}
    headers = {"X-Request-Id": "replay-whole"}
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        first = await client.post("/v1/chat/completions", json=body, headers=headers)
        before = service.metrics.engine_generations._value.get()
        second = await client.post("/v1/chat/completions", json=body, headers=headers)
    assert first.json() == second.json()
    assert service.metrics.engine_generations._value.get() == before


async def test_same_id_with_another_body_is_422(base_url: str, service: Service) -> None:
    headers = {"X-Request-Id": "conflict"}
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        await client.post("/v1/chat/completions", json=sampled_chat(8), headers=headers)
        before = service.metrics.engine_generations._value.get()
        other = await client.post("/v1/chat/completions", json=sampled_chat(9), headers=headers)
    assert other.status_code == 422
    assert other.json()["error"]["code"] == "request_id_conflict"
    assert service.metrics.engine_generations._value.get() == before


async def read_events(response: httpx.Response, count: int) -> list[bytes]:
    """Read `count` whole SSE events from a streaming response."""
    events: list[bytes] = []
    buffer = b""
    async for piece in response.aiter_raw():
        buffer += piece
        while b"\n\n" in buffer and len(events) < count:
            event, buffer = buffer.split(b"\n\n", 1)
            events.append(event + b"\n\n")
        if len(events) >= count:
            break
    return events


async def test_resume_after_k_events_gives_exactly_the_uninterrupted_text(base_url: str) -> None:
    headers = {"X-Request-Id": "resume-k", "Accept": "text/event-stream"}
    body = sampled_chat(200)
    k = 7
    async with (
        httpx.AsyncClient(base_url=base_url, timeout=60) as client,
        client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as watcher,
    ):
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as cut:
            first_part = await read_events(cut, k)
        # The cut connection is closed; the watcher keeps the generation attached.
        resumed = await client.post(
            "/v1/chat/completions", json=body, headers={**headers, "Last-Event-ID": str(k)}
        )
        uninterrupted = await watcher.aread()
    assert [event_id for event_id, _ in sse_events(b"".join(first_part))] == list(range(1, k + 1))
    assert sse_events(resumed.content)[0][0] == k + 1
    assert b"".join(first_part) + resumed.content == uninterrupted
    assert texts_of(b"".join(first_part) + resumed.content) == texts_of(uninterrupted)


class CuttingTransport(httpx.AsyncBaseTransport):
    """Breaks the first `cuts` streaming responses in the middle of an event, after a few whole
    ones, like a flaky network. Counted in events, not network reads: how many reads a stream
    takes depends on timing (a finished generation can arrive in one read and never be cut)."""

    def __init__(self, cuts: int, after_events: int = 3) -> None:
        self._inner = httpx.AsyncHTTPTransport()
        self.cuts_left = cuts
        self.after_events = after_events

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self._inner.handle_async_request(request)
        if self.cuts_left <= 0 or request.url.path.endswith("/cancel"):
            return response
        self.cuts_left -= 1
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            stream=_Cut(response, self.after_events),
            request=request,
        )

    async def aclose(self) -> None:
        await self._inner.aclose()


class _Cut(httpx.AsyncByteStream):
    """`after` whole events, then the first half of the next one, then a broken connection."""

    def __init__(self, response: httpx.Response, after: int) -> None:
        self._response = response
        self._after = after

    async def __aiter__(self) -> AsyncIterator[bytes]:
        buffer = b""
        async for chunk in self._response.aiter_raw():
            buffer += chunk
            events = buffer.split(b"\n\n")
            if len(events) > self._after + 1:  # the next event has begun: cut inside it
                head = b"".join(event + b"\n\n" for event in events[: self._after])
                yield head + events[self._after][: len(events[self._after]) // 2 + 1]
                raise httpx.ReadError("connection cut by the test")
        yield buffer  # shorter than the cut point: the whole stream

    async def aclose(self) -> None:
        await self._response.aclose()


async def test_resumable_client_survives_five_disconnects(base_url: str, service: Service) -> None:
    transport = CuttingTransport(cuts=5)
    http = httpx.AsyncClient(transport=transport, base_url=base_url, timeout=60)
    client = ResumableClient(base_url, http=http, backoff_s=0.01)
    body = sampled_chat(300)
    params = {k: v for k, v in body.items() if k not in ("messages", "stream")}
    before = service.metrics.engine_generations._value.get()
    async with client:
        pieces = [p async for p in client.stream_chat(body["messages"], request_id="five-cuts", **params)]
        assert client.reconnects == 5
    assert transport.cuts_left == 0
    assert service.metrics.engine_generations._value.get() - before == 1
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as plain:
        replay = await plain.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "five-cuts"})
    assert "".join(pieces) == texts_of(replay.content)


def held_chat(held: Hold, max_tokens: int = 1900) -> dict[str, Any]:
    return long_chat(max_tokens=max_tokens, messages=[{"role": "user", "content": held.prompt("a story")}])


async def test_disconnect_with_id_aborts_after_the_grace_window(live: LiveServers, gate: Gate) -> None:
    grace_s = 1.0
    url, service = live.serve(disconnect_grace_s=grace_s)
    # Frozen in the engine after 3 deltas: the request can only end by the server's abort.
    with gate.hold(after=3, freeze_engine=True) as held:
        async with (
            httpx.AsyncClient(base_url=url, timeout=60) as client,
            client.stream(
                "POST", "/v1/chat/completions", json=held_chat(held), headers={"X-Request-Id": "grace"}
            ) as response,
        ):
            await held.until_held()
            await read_events(response, 1)
        left = time.monotonic()
        assert service.engine.running_requests() == 1  # still generating for a returning client
        while service.engine.running_requests() and time.monotonic() - left < 60:
            await asyncio.sleep(0.05)
        waited = time.monotonic() - left
    assert service.engine.running_requests() == 0
    assert waited >= grace_s - 0.1  # held for the grace window; the reason below says the timer ended it
    metrics = httpx.get(f"{url}/metrics").text
    assert 'bundle_aborted_requests_total{reason="grace_expired"} 1.0' in metrics


async def test_cancel_aborts_at_once_and_ends_attached_streams(
    base_url: str, service: Service, gate: Gate
) -> None:
    headers = {"X-Request-Id": "to-cancel"}
    # Frozen in the engine: while the hold is closed, nothing but the cancel can end the stream.
    with gate.hold(after=1, freeze_engine=True) as held:
        async with (
            httpx.AsyncClient(base_url=base_url, timeout=60) as client,
            client.stream("POST", "/v1/chat/completions", json=held_chat(held), headers=headers) as stream,
        ):
            chunks = stream.aiter_raw()
            await anext(chunks)
            await held.until_held()
            async with asyncio.timeout(60):  # a cancel that did not abort would wait for ever
                cancelled = await client.post("/v1/requests/to-cancel/cancel")
                rest = b"".join([chunk async for chunk in chunks])
            assert cancelled.json()["status"] == "cancelled"
            assert service.engine.running_requests() == 0  # aborted inside vLLM, not just here
            tail = rest.rstrip().split(b"\n\n")
            assert tail[-1].endswith(b"data: [DONE]")
            assert b'"code":"request_cancelled"' in tail[-2]
            unknown = await client.post("/v1/requests/never-seen/cancel")
            assert unknown.status_code == 404


async def test_evicted_events_give_a_clear_error(live: LiveServers) -> None:
    url, _ = live.serve(max_events_per_request=16)
    headers = {"X-Request-Id": "evicted"}
    body = long_chat(max_tokens=100)
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        full = await client.post("/v1/chat/completions", json=body, headers=headers)
        assert full.status_code == 200  # a live reader is never cut short by the buffer
        assert len(sse_events(full.content)) > 16
        gone = await client.post("/v1/chat/completions", json=body, headers={**headers, "Last-Event-ID": "1"})
        assert gone.status_code == 410
        assert gone.json()["error"]["code"] == "events_gone"
        never = await client.post(
            "/v1/chat/completions",
            json=body,
            headers={"X-Request-Id": "never-started", "Last-Event-ID": "3"},
        )
        assert never.status_code == 410
    async with ResumableClient(url) as resumable:
        with pytest.raises(StreamGone):
            async for _ in resumable.stream_chunks(
                "/v1/chat/completions", body, request_id="evicted", last_event_id=1
            ):
                raise AssertionError("no chunk may arrive after a gap")


async def test_thousand_cycles_stay_within_bounds(live: LiveServers) -> None:
    bounds = {"max_held_requests": 50, "max_events_per_request": 64, "disconnect_grace_s": 2.0}
    url, service = live.serve(**bounds)
    body = long_chat(max_tokens=8)
    semaphore = asyncio.Semaphore(16)

    async def cycle(client: httpx.AsyncClient, index: int) -> str:
        headers = {"X-Request-Id": f"cycle-{index}"}
        async with semaphore:
            async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
                head = await read_events(r, 2)
            rest = await client.post(
                "/v1/chat/completions", json=body, headers={**headers, "Last-Event-ID": "2"}
            )
            assert rest.status_code == 200, rest.text
            return texts_of(b"".join(head) + rest.content)

    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        texts = await asyncio.gather(*(cycle(client, i) for i in range(1000)))
    assert all(texts)
    stats = service.stats()
    assert stats["held_requests"] <= bounds["max_held_requests"]
    assert stats["held_events"] <= bounds["max_held_requests"] * bounds["max_events_per_request"]
    assert stats["running_generations"] == 0 and stats["subscribers"] == 0
    assert service.engine.running_requests() == 0


async def test_client_says_it_cannot_resume_a_server_without_event_ids() -> None:
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        chunk = orjson.dumps({"choices": [{"index": 0, "delta": {"content": "hi"}}]})

        async def body() -> AsyncIterator[bytes]:
            yield b"data: " + chunk + b"\n\n"
            raise httpx.ReadError("dropped")

        return httpx.Response(200, stream=_Stream(body()), headers={"content-type": "text/event-stream"})

    http = httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://plain")
    async with ResumableClient("http://plain", http=http, backoff_s=0) as client:
        seen = []
        with pytest.raises(ResumeUnsupported):
            async for piece in client.stream_chat([{"role": "user", "content": "x"}], model="m"):
                seen.append(piece)
    assert seen == ["hi"] and calls == 1


async def test_client_streams_from_a_plain_openai_server_without_ids() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        events = [orjson.dumps({"choices": [{"index": 0, "delta": {"content": t}}]}) for t in "abc"]
        raw = b"".join(b"data: " + e + b"\n\n" for e in events) + b"data: [DONE]\n\n"
        return httpx.Response(200, content=raw, headers={"content-type": "text/event-stream"})

    http = httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://plain")
    async with ResumableClient("http://plain", http=http) as client:
        text = "".join([p async for p in client.stream_chat([{"role": "user", "content": "x"}], model="m")])
    assert text == "abc"


class _Stream(httpx.AsyncByteStream):
    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self._chunks = chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._chunks:
            yield chunk
