"""The core client reads Replicate's hosted stream format (events `output` with plain text,
`error`, `done`). Replicate cannot be reached from here, so the events are served locally in
the documented shape; the Cog server's own format is tested against the real server in
test_cog.py."""

from __future__ import annotations

import httpx
import pytest

from bundle_client.client import ResumableClient, ServerError


def replicate_stream(events: list[tuple[str, str]]) -> httpx.MockTransport:
    body = "".join(f"event: {name}\nid: {i}\ndata: {data}\n\n" for i, (name, data) in enumerate(events))

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.headers["accept"] == "text/event-stream"
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler)


async def client_for(transport: httpx.MockTransport) -> ResumableClient:
    return ResumableClient("http://r", http=httpx.AsyncClient(transport=transport, base_url="http://r"))


async def test_replicate_output_events_are_the_text() -> None:
    client = await client_for(
        replicate_stream([("output", "Hel"), ("output", "lo"), ("output", " {x}"), ("done", "{}")])
    )
    async with client:
        text = "".join([p async for p in client.stream_url("http://r/v1/streams/abc")])
    assert text == "Hello {x}"


async def test_replicate_error_and_cancel_raise() -> None:
    failing = await client_for(replicate_stream([("output", "a"), ("error", "CUDA out of memory")]))
    async with failing:
        with pytest.raises(ServerError, match="CUDA out of memory"):
            [p async for p in failing.stream_url("http://r/s")]
    cancelled = await client_for(replicate_stream([("output", "a"), ("done", '{"reason": "canceled"}')]))
    async with cancelled:
        with pytest.raises(ServerError, match="cancelled"):
            [p async for p in cancelled.stream_url("http://r/s")]
