"""The replay buffer: one stream's SSE events, numbered from 1, held for any number of readers.

Every event has a sequence number (a reader's cursor); it goes on the wire as an `id:` line only
for a stream that can be resumed and whose client reads SSE proper (its request has an
X-Request-Id and asks for text/event-stream; the service decides when it opens the generation). Any other
stream is framed as plain `data:` events, as OpenAI's are.

A generation's producer appends events; every client follows the buffer from an event id, so
attaching a duplicate, resuming after a dropped connection and replaying a finished result are
the same operation. A reader that falls behind receives its backlog in one write, which
coalesces tokens under load for free. Under heavy load a reader may also ask to be woken only
once several new events exist (`events_per_write`): fewer wake-ups and socket writes per token
on the event loop that also takes the engine's outputs in, the events themselves unchanged.

A caught-up reader whose server can write a chunk at once (`write_now`, shared/http/direct_write.py)
hands that write to the buffer and sleeps: `append` then puts each new event on the reader's
connection itself, in the producer's turn of the event loop, instead of waking the reader's task
for it (one turn per token and stream instead of two, and no trip through three async
generators). The first write that cannot be made at once (the client reads slowly), a second
reader's wish to be paced, or the end wakes the reader, which goes on from the first event not
written, the way any reader does.

`EventLog` is the seam: this in-process buffer is one implementation, and a shared store (events
of a generation readable from another replica) can be another, behind the same methods.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

from shared.errors import EventsGone, InvalidRequest
from shared.streaming import error_frames, sse_data, sse_event

# How many new events a caught-up reader waits for before its next write (see `follow`).
EventsPerWrite = Callable[[], int]
# Takes one chunk for the reader's connection, to go out ahead of anything sent to it in a later
# event-loop turn, and says True; or takes nothing and says False.
WriteNow = Callable[[bytes], bool]

# Events every stream gets the moment they exist, whatever the load: a chat stream's role
# opening and its first token, a completion's first two tokens. Time to first token is never
# traded for fewer writes.
UNBATCHED_EVENTS = 2


class EventLog(Protocol):
    """What a stream's readers and its one writer need from the place its events live."""

    closed: bool

    def append(self, data: bytes) -> None: ...

    def close(self) -> None: ...

    def check_resumable(self, last_event_id: int) -> None: ...

    def follow(
        self,
        last_event_id: int,
        coalesce_s: float = 0.0,
        events_per_write: EventsPerWrite | None = None,
        write_now: WriteNow | None = None,
    ) -> AsyncIterator[bytes]: ...

    def held_events(self) -> int: ...


class Notifier:
    """Wakes every waiter at once. One shared future per wake-up: cheaper than an asyncio.Event
    per event on the per-token path (profiled), and none at all while nobody waits. Waiters
    re-check their state after waking, so a spurious wake-up is harmless."""

    def __init__(self) -> None:
        self._waiter: asyncio.Future[None] | None = None

    def notify(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self) -> None:
        if self._waiter is None or self._waiter.done():
            self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        except asyncio.CancelledError:
            # Awaiting a shared future: a cancelled waiter cancels it for everyone. Only the
            # waiter that is itself being cancelled re-raises; the others just wake up.
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise


class ReplayBuffer:
    """`EventLog` in this process's memory, bounded to `max_events` (oldest dropped first)."""

    def __init__(self, max_events: int, *, numbered: bool) -> None:
        self.max_events = max_events
        self.numbered = numbered  # `id:` lines on the wire (see the module's docstring)
        self.events: list[bytes] = []
        self.first_sequence = 1  # sequence number of events[0]; grows as old events are dropped
        self.next_sequence = 1
        self.closed = False
        self.changed = Notifier()
        # The sequence number whose append wakes the waiting readers (the earliest any of them
        # asked for); None: every append does.
        self._wake_at: int | None = None
        self._sink: _Sink | None = None  # the one reader `append` writes to directly, if any

    # --- the writer -----------------------------------------------------------------------------
    def preload(self, datas: list[bytes]) -> None:
        """Events sent before this buffer existed (by the replica a takeover continues), from 1:
        held for resumes, before any reader."""
        for data in datas:
            self.append(data)

    def append(self, data: bytes) -> None:
        event = sse_event(self.next_sequence, data) if self.numbered else sse_data(data)
        self.events.append(event)
        if self._sink is not None:
            self._write_to_sink(self._sink, event)
        self.next_sequence += 1
        overflow = len(self.events) - self.max_events
        if overflow > 0:
            # Drop a quarter at once so trimming is amortised O(1) per event.
            drop = max(overflow, self.max_events // 4)
            del self.events[:drop]
            self.first_sequence += drop
        if self._wake_at is None or self.next_sequence > self._wake_at:
            self._wake_at = None
            self.changed.notify()

    def close(self) -> None:
        self.closed = True
        self._wake_at = None
        self._release_sink()
        self.changed.notify()

    def _write_to_sink(self, sink: _Sink, event: bytes) -> None:
        if sink.cursor == self.next_sequence:
            try:
                written = sink.write_now(event)
            except Exception:  # the reader's own path will meet (and report) the same failure
                written = False
            if written:
                sink.cursor += 1
                return
        self._release_sink()

    def _release_sink(self) -> None:
        sink, self._sink = self._sink, None
        if sink is not None and not sink.woken.done():
            sink.woken.set_result(None)

    # --- readers --------------------------------------------------------------------------------
    def check_resumable(self, last_event_id: int) -> None:
        """Refuse before any byte is sent if a resume cannot be served without a gap."""
        if last_event_id + 1 < self.first_sequence:
            raise EventsGone(
                f"events after {last_event_id} are no longer held (oldest held: "
                f"{self.first_sequence}); restart the request with a new X-Request-Id"
            )
        if last_event_id >= self.next_sequence:
            # No client can have seen an event not yet written, running stream or not: answering
            # 200 would wait for an id that may never come (or end without [DONE]).
            raise InvalidRequest(
                f"Last-Event-ID {last_event_id} is beyond the last event sent ({self.next_sequence - 1})",
                param="Last-Event-ID",
            )

    async def follow(
        self,
        last_event_id: int,
        coalesce_s: float = 0.0,
        events_per_write: EventsPerWrite | None = None,
        write_now: WriteNow | None = None,
    ) -> AsyncIterator[bytes]:
        """Yield every event after `last_event_id`, then live ones until the stream ends.

        `events_per_write()`, asked before each wait once the stream's first events are out:
        how many new events to wait for (the end of the stream always wakes the reader).
        `write_now`: this reader's connection takes chunks directly (module docstring); used
        while the reader is caught up, unpaced and the only one doing so."""
        cursor = last_event_id + 1
        while True:
            if cursor < self.first_sequence:
                # This reader fell further behind than the buffer holds: say so and stop.
                yield error_frames(EventsGone("this reader fell behind and events were dropped"))
                return
            if cursor < self.next_sequence:
                backlog = self.events[cursor - self.first_sequence :]
                cursor = self.next_sequence
                yield backlog[0] if len(backlog) == 1 else b"".join(backlog)
                continue
            if self.closed:
                return
            if write_now is not None and self._sink is None and not coalesce_s and events_per_write is None:
                cursor = await self._written_directly(write_now, cursor)
                continue
            self._wake_when_held(cursor + _events_to_wait_for(cursor, events_per_write) - 1)
            await self.changed.wait()
            if coalesce_s:
                await asyncio.sleep(coalesce_s)

    async def _written_directly(self, write_now: WriteNow, cursor: int) -> int:
        """Sleep while `append` writes each new event straight to this reader's connection;
        return the sequence number of the first event it did not write."""
        sink = _Sink(write_now, cursor, asyncio.get_running_loop().create_future())
        self._sink = sink
        try:
            await sink.woken
        finally:  # also when the reader is cancelled (its client left): stop writing to it
            if self._sink is sink:
                self._sink = None
        return sink.cursor

    def held_events(self) -> int:
        return len(self.events)

    def _wake_when_held(self, sequence: int) -> None:
        # Every waiting reader is caught up, so they differ only in how many events they want;
        # the earliest wins (a reader woken early just writes what there is).
        self._wake_at = sequence if self._wake_at is None else min(self._wake_at, sequence)


@dataclass(slots=True)
class _Sink:
    """A sleeping reader that `append` writes to: its write, the next event it has not got, and
    the future that wakes it."""

    write_now: WriteNow
    cursor: int
    woken: asyncio.Future[None]


def _events_to_wait_for(cursor: int, events_per_write: EventsPerWrite | None) -> int:
    if events_per_write is None or cursor <= UNBATCHED_EVENTS:
        return 1
    return max(1, events_per_write())
