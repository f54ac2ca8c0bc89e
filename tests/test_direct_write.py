"""shared/http/direct_write.py against the real uvicorn: a chunk written directly is framed as
uvicorn's own `send` frames one, goes out at the next turn of the event loop (a `send` after
that turn follows it in order), and is only offered by the httptools protocol (h11 and anything
else: none); an empty chunk never reaches the socket (framed, it would end the body); every
fall-back to `send` is reported with its reason, and counted in the metric. No engine: part of
`make check`."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from shared.http.api import create_app
from shared.http.direct_write import direct_write
from shared.http.limits import bounded_httptools_protocol
from shared.obs.metrics import Metrics
from shared.settings import Settings

from .scripted import ScriptedEngine


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Recorder:
    """An ASGI app that streams four chunks, alternating the direct write and `send`."""

    def __init__(self) -> None:
        self.offered: bool | None = None
        self.written: list[bool] = []
        self.fallbacks: list[str] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        write_now = direct_write(send, self.fallbacks.append)
        self.offered = write_now is not None
        if write_now is not None:
            self.written.append(write_now(b"too early"))  # no head sent yet: refused, nothing written
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]}
        )
        for index, chunk in enumerate((b"data: 1\n\n", b"data: 2\n\n", b"data: 3\n\n", b"data: 4\n\n")):
            if write_now is not None and index % 2 == 0:
                self.written.append(write_now(chunk))
                await asyncio.sleep(0)  # queued chunks go out in the next turn: `send` only after it
            else:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        if write_now is not None:
            self.written.append(write_now(b"too late"))  # the response is complete: refused


async def _stream_once(http: Any) -> tuple[Recorder, bytes]:
    app = Recorder()
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http=http, log_level="warning"))
    serving = asyncio.create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient() as client:
            response = await client.post(f"http://127.0.0.1:{port}/")
        return app, response.content
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 10)


async def test_httptools_offers_a_direct_write_that_interleaves_with_send_in_order() -> None:
    protocol = bounded_httptools_protocol(8192, 5.0)
    if protocol is None:
        pytest.skip("no httptools here")
    for http in ("httptools", protocol):  # uvicorn's own, and the bundle's bounded subclass
        app, body = await _stream_once(http)
        assert app.offered
        assert app.written == [False, True, True, False]
        assert app.fallbacks == ["not_started", "complete"]
        assert body == b"data: 1\n\ndata: 2\n\ndata: 3\n\ndata: 4\n\n"


async def test_h11_offers_none_and_streams_as_before() -> None:
    app, body = await _stream_once("h11")
    assert app.offered is False and app.written == []
    assert app.fallbacks == ["server"]
    assert body == b"data: 1\n\ndata: 2\n\ndata: 3\n\ndata: 4\n\n"


class EmptyChunks:
    """Streams two events by direct write with an empty chunk before, between and after them,
    as a producer with nothing new to say would hand one over."""

    def __init__(self) -> None:
        self.written: list[bool] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        write_now = direct_write(send)
        assert write_now is not None
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]}
        )
        for chunk in (b"", b"data: 1\n\n", b"", b"data: 2\n\n", b""):
            self.written.append(write_now(chunk))
            await asyncio.sleep(0)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def test_an_empty_chunk_never_reaches_the_socket() -> None:
    """Read off the socket itself: a client stops at the first `0\\r\\n\\r\\n` and would not show
    what follows; the bytes must be the two chunks, then the one terminator uvicorn writes."""
    protocol = bounded_httptools_protocol(8192, 5.0)
    if protocol is None:
        pytest.skip("no httptools here")
    app = EmptyChunks()
    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, http=protocol, log_level="warning")
    )
    serving = asyncio.create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n")
        raw = await asyncio.wait_for(reader.read(), 10)  # to the server's close
        writer.close()
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 10)
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower()
    assert body == b"9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\n0\r\n\r\n"
    assert app.written == [True] * 5  # nothing to write is no reason to fall back to `send`


def test_fallbacks_are_counted_by_reason() -> None:
    metrics = Metrics()
    for reason in ("server", "paused", "paused"):
        metrics.direct_write_fallbacks.labels(reason).inc()
    text = metrics.exposition().decode()
    assert 'bundle_direct_write_fallbacks_total{reason="paused"} 2.0' in text
    assert 'bundle_direct_write_fallbacks_total{reason="server"} 1.0' in text


async def _fallbacks_of_one_stream(http: str, **settings: Any) -> str:
    """The bundle's app (scripted engine) under uvicorn with `http`: one streamed chat, then its
    /metrics' direct-write fallback lines."""
    app = create_app(Settings(**settings), engine=ScriptedEngine(auto=True))
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http=http, log_level="warning"))
    serving = asyncio.create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": "a b"}],
                "max_tokens": 3,
                "stream": True,
            }
            streamed = await client.post("/v1/chat/completions", json=body)
            assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
            text = (await client.get("/metrics")).text
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 10)
    return "\n".join(
        line for line in text.splitlines() if line.startswith("bundle_direct_write_fallbacks_total")
    )


async def test_the_app_counts_a_stream_on_a_server_without_direct_writes() -> None:
    assert await _fallbacks_of_one_stream("h11", stream_direct_writes=True) == (
        'bundle_direct_write_fallbacks_total{reason="server"} 1.0'
    )
    assert await _fallbacks_of_one_stream("h11") == ""  # off by default: none tried
