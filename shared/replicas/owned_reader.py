"""A reader of a generation this replica runs, that goes on from the shared log should another
replica take the generation over meanwhile (`OwnedReader`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from shared.errors import BundleError
from shared.generation.replay import EventsPerWrite, WriteNow
from shared.generation.subscription import Subscription
from shared.replicas.redis_log import SharedLog
from shared.streaming import Usage, error_frames

DONE_FRAME_END = b"data: [DONE]\n\n"  # how a whole stream's last event ends, numbered or not


class OwnedReader:
    """A reader of a generation this replica runs (a `Subscription`). Another replica may take the
    generation over meanwhile (this one was paused past its lease, or cut off from the store):
    then the log here stops short of [DONE], and the reader goes on from the shared log, the
    taker's tokens, after the last event it got here. With takeover, an event reaches a reader
    here only once the store holds it, so nothing it got is missing from that log, and its client
    sees one stream, byte for byte what every other client of the id sees."""

    def __init__(
        self,
        local: Subscription,
        shared: SharedLog,
        after: int,
        from_log: Callable[[int], Awaitable[Subscription]],
    ) -> None:
        self._local = local
        self._shared = shared
        self._after = after
        self._from_log = from_log

    @property
    def request_id(self) -> str | None:
        return self._local.request_id

    @property
    def stream(self) -> bool:
        return self._local.stream

    @property
    def usage(self) -> Usage:
        return self._local.usage

    async def admitted(self) -> None:
        await self._local.admitted()

    async def events(
        self,
        coalesce_s: float = 0.0,
        events_per_write: EventsPerWrite | None = None,
        write_now: WriteNow | None = None,
    ) -> AsyncIterator[bytes]:
        sent = self._after  # the sequence of the last event this reader got
        last = b""

        def counted(chunk: bytes) -> bool:
            nonlocal sent
            taken = write_now is not None and write_now(chunk)
            if taken:
                sent += chunk.count(b"\n\n")  # one SSE event each: JSON data holds no blank line
            return taken

        async for chunk in self._local.events(coalesce_s, events_per_write, counted if write_now else None):
            sent += chunk.count(b"\n\n")
            last = chunk
            yield chunk
        if not self._shared.taken_over or last.endswith(DONE_FRAME_END):
            return
        try:
            remote = await self._from_log(sent)
        except BundleError as error:
            yield error_frames(error)
            return
        async for chunk in remote.events():
            yield chunk

    def text(self) -> AsyncIterator[str]:
        return self._local.text()

    async def response(self) -> dict[str, Any]:
        return await self._local.response()

    def close(self) -> None:
        self._local.close()

    def abandon(self) -> None:
        self._local.abandon()
