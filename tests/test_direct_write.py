"""shared/http/direct_write.py against the real uvicorn: a chunk written directly is framed as
uvicorn's own `send` frames one, goes out at the next turn of the event loop (a `send` after
that turn follows it in order), and is only offered by the httptools protocol (h11 and anything
else: none). No engine: part of `make check`."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from shared.http.direct_write import direct_write
from shared.http.limits import bounded_httptools_protocol


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Recorder:
    """An ASGI app that streams four chunks, alternating the direct write and `send`."""

    def __init__(self) -> None:
        self.offered: bool | None = None
        self.written: list[bool] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        write_now = direct_write(send)
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
        assert body == b"data: 1\n\ndata: 2\n\ndata: 3\n\ndata: 4\n\n"


async def test_h11_offers_none_and_streams_as_before() -> None:
    app, body = await _stream_once("h11")
    assert app.offered is False and app.written == []
    assert body == b"data: 1\n\ndata: 2\n\ndata: 3\n\ndata: 4\n\n"
