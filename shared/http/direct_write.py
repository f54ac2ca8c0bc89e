"""A body chunk written onto the connection at once, from whichever task made it: uvicorn's
response cycle framed and written to directly, skipping the server's `send`.

Streaming through ASGI costs each token of each stream two turns of the one event loop: the
generation's task appends the event, then the response's task wakes to hand it to the server's
`send`. At 256 streams that loop is the API process's bottleneck (docs/performance.md), and
first tokens wait in it behind everyone's later ones. With a direct write the event log puts a
caught-up stream's events on its connection in the producer's own turn (shared/generation/replay.py).

Only where it is exactly what the server itself would do: uvicorn's httptools protocol (the deploy
images' HTTP stack), a response whose head is out with chunked transfer encoding and not yet
complete, the client connected and the transport not asking for back-pressure. `write_now` then
frames the chunk as uvicorn's `send` frames a body message with more to come, queues it and says
True; in any other state it queues nothing and says False, and the chunk goes through `send` as
usual (which waits for a slow client). Any other server (h11, Modal's ASGI runner, test clients)
gets no direct write at all. Each fall-back to `send` is reported with its reason (`on_fallback`,
the `bundle_direct_write_fallbacks_total` metric): `server` (no direct write on this server, once
per stream), `disconnected`, `paused` (back-pressure), `not_started`, `complete`, `not_chunked`.
An empty chunk is written as nothing (and said True): framed, it would be `0\r\n\r\n`, the end
of a chunked body, where uvicorn's own `send` writes nothing for it. What it reads of uvicorn's
cycle it reads through shared/http/server_internals.py: a release without it gets no direct write.

The queued chunks of every connection go to their transports together, in one callback at the
start of the event loop's next turn: written as each is made instead, the writes of one engine
step spread over the whole turn that hands its outputs round, and on 2 cores the clients then
saw their events later (docs/performance.md, "Direct writes"). The order on a connection holds
because whoever uses `send` after a direct write does so in a later turn (the event log wakes
its reader with `call_soon`, behind this callback).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from starlette.types import Send

from shared.generation.replay import WriteNow
from shared.http.server_internals import cycle_transport, response_cycle, unwritable

Fallback = Callable[[str], None]  # told the reason each time a chunk must go through `send`


def direct_write(send: Send, on_fallback: Fallback = lambda reason: None) -> WriteNow | None:
    """The direct write for the connection behind `send` (the server's own ASGI send, not a
    middleware's wrapper), or None where the server offers none we can use safely. Every time
    a chunk must go through `send` instead, `on_fallback(reason)` is told why."""
    cycle = response_cycle(send)
    if cycle is None:
        on_fallback("server")
        return None
    return _chunk_writer(cycle, on_fallback)


def _chunk_writer(cycle: Any, on_fallback: Fallback) -> WriteNow:
    transport = cycle_transport(cycle)

    def write_now(chunk: bytes) -> bool:
        refusal = unwritable(cycle)
        if refusal is not None:
            on_fallback(refusal)
            return False
        if chunk:  # framed, an empty chunk would end the body (module docstring)
            _queue(transport, b"%x\r\n%s\r\n" % (len(chunk), chunk))
        return True

    return write_now


# Per event loop (tests run several), the chunks waiting for the next turn's flush; an entry
# lives from the turn's first direct write to its flush.
_waiting: dict[asyncio.AbstractEventLoop, list[tuple[Any, bytes]]] = {}


def _queue(transport: Any, data: bytes) -> None:
    loop = asyncio.get_running_loop()
    batch = _waiting.get(loop)
    if batch is None:
        batch = _waiting[loop] = []
        loop.call_soon(_flush, loop)
    batch.append((transport, data))


def _flush(loop: asyncio.AbstractEventLoop) -> None:
    for transport, data in _waiting.pop(loop, ()):
        if not transport.is_closing():  # the client left since: uvloop refuses a closed transport
            transport.write(data)
