"""Events of a generation in the shared store: written by its owner, followed from any replica.

- `StreamWriter` batches the appends of every stream this replica owns: all events queued while
  one pipeline is in flight go out in the next, so hundreds of streams cost one round trip per
  flush, not one per token.
- `SharedLog` is the owner's `EventLog`: its own readers keep following the in-memory buffer;
  each event is also queued for the shared stream with its sequence number.
- `RemoteSubscription` is a reader on another replica (or on the owner after it let the result go
  from memory): it re-frames the stored data as the claim says (`sse_event` when the creator's
  stream is numbered, `sse_data` otherwise), so its bytes equal the owner's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson

from shared.errors import BundleError, EventsGone, ProducerLost, StoredError, StoreUnavailable
from shared.identity.replay import EventsPerWrite, ReplayBuffer, WriteNow
from shared.identity.store import (
    BODY,
    CHECK_EVERY_S,
    DATA,
    PRODUCER_LOST_BOUND_S,
    RECONNECT_S,
    RUNNING,
    AppendBatch,
    Claim,
    IdentityStore,
    claim_key,
    events_key,
)
from shared.obs.metrics import Metrics
from shared.streaming import DONE_DATA, Usage, error_frames, sse_data, sse_event

log = logging.getLogger(__name__)

Events = list[tuple[str, int, bytes]]  # (request id, sequence, data)
Finals = list[tuple[str, "Claim", bytes | None]]  # (request id, final claim, non-streaming answer)
# An error event inside a stream carries no HTTP status (the 200 was sent long before): a text
# reader raises it as a server-side failure, its OpenAI type and code kept.
GENERATION_ERROR_STATUS = 500


class StreamWriter:
    def __init__(
        self,
        store: IdentityStore,
        max_events: int,
        retention_s: float,
        running_ttl_s: float,
        window_s: float = 0.0,
    ) -> None:
        self._store = store
        # Each write waits this long first, gathering what comes meanwhile: at one stream a
        # token every ~5 ms would otherwise cost a round trip each (and the syscalls with it).
        self._window_s = window_s
        self._max_events = max_events
        self._retention_ms = max(int(retention_s * 1000), 1)
        # A stream whose owner dies is never finished: it still expires, after the longest
        # generation plus the retention window.
        self._running_ttl_ms = max(int(running_ttl_s * 1000), 1)
        self._events: Events = []
        self._finals: Finals = []
        self._new_streams: set[str] = set()
        self._flusher: asyncio.Task[None] | None = None
        self._failing = False

    def append(self, request_id: str, sequence: int, data: bytes) -> None:
        self._events.append((request_id, sequence, data))
        self._kick()

    def finish(self, request_id: str, claim: Claim, body: bytes | None) -> None:
        """The end: the final claim state (and a non-streaming answer), after all its events."""
        self._finals.append((request_id, claim, body))
        self._kick()

    async def drain(self, timeout_s: float | None = None) -> None:
        """Wait until everything queued is written; with `timeout_s`, give up after it (the ends
        of a store that stays down are lost, and readers elsewhere find the claim gone later)."""
        if self._flusher is None or self._flusher.done():
            return
        flushed = await asyncio.wait({self._flusher}, timeout=timeout_s)
        if not flushed[0]:
            self._flusher.cancel()
            log.error("store unavailable at exit: the last ends of shared streams were not written")

    def _kick(self) -> None:
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        while True:
            # At least one loop turn before each write: every producer woken in this turn (or
            # in this window) queues its events first.
            await asyncio.sleep(self._window_s)
            if not (self._events or self._finals):
                return
            events, self._events = self._events, []
            finals, self._finals = self._finals, []
            try:
                await self._store.append(self._batch(events, finals))
            except StoreUnavailable:
                # Counted in /metrics; logged once per outage. Followers see the gap in sequence
                # numbers and say so; the owner's own readers are unaffected. The ends are kept
                # and written once the store answers: without its end a stream's claim would say
                # "running" until it expires, and readers elsewhere would wait that long.
                if not self._failing:
                    log.warning("store unavailable: events of shared streams are being dropped")
                self._failing = True
                self._finals[:0] = finals
                await asyncio.sleep(RECONNECT_S)
            else:
                self._failing = False

    def _batch(self, events: Events, finals: Finals) -> AppendBatch:
        """The flush as APPEND_SCRIPT's keys and arguments (see shared/identity/store.py)."""
        batch = AppendBatch(args=[self._max_events, self._running_ttl_ms, self._retention_ms, len(events)])
        for request_id, sequence, data in events:
            new = request_id not in self._new_streams
            self._new_streams.add(request_id)
            batch.keys.append(events_key(request_id))
            batch.args += [sequence, data, 1 if new else 0]
            batch.commands += 2 if new else 1
        for request_id, claim, body in finals:
            batch.keys += [events_key(request_id), claim_key(request_id)]
            batch.args += [body or b"", claim.encode()]
            self._new_streams.discard(request_id)
            batch.commands += 3 if body is not None else 2
        return batch


class SharedLog:
    """`EventLog` of a generation this replica owns: memory first, the shared stream behind."""

    def __init__(self, local: ReplayBuffer, writer: StreamWriter, request_id: str) -> None:
        self._local = local
        self._writer = writer
        self._request_id = request_id

    @property
    def numbered(self) -> bool:
        """Whether the events carry `id:` lines (the creator's framing, which followers copy)."""
        return self._local.numbered

    @property
    def closed(self) -> bool:
        return self._local.closed

    @closed.setter
    def closed(self, value: bool) -> None:
        self._local.closed = value

    def append(self, data: bytes) -> None:
        sequence = self._local.next_sequence
        self._local.append(data)
        self._writer.append(self._request_id, sequence, data)

    def close(self) -> None:
        self._local.close()

    def check_resumable(self, last_event_id: int) -> None:
        self._local.check_resumable(last_event_id)

    def follow(
        self,
        last_event_id: int,
        coalesce_s: float = 0.0,
        events_per_write: EventsPerWrite | None = None,
        write_now: WriteNow | None = None,
    ) -> AsyncIterator[bytes]:
        return self._local.follow(last_event_id, coalesce_s, events_per_write, write_now)

    def held_events(self) -> int:
        return self._local.held_events()


class RemoteSubscription:
    """A reader of a generation owned elsewhere: a `shared.identity.interface.Subscription`, as this
    replica's own readers are."""

    def __init__(
        self, store: IdentityStore, request_id: str, claim: Claim, after: int, metrics: Metrics
    ) -> None:
        self._store = store
        self._request_id = request_id
        self._owner = claim.owner
        self._stream = claim.stream
        self._numbered = claim.numbered
        self._after = after
        self._metrics = metrics
        self._usage = Usage(0)

    @property
    def request_id(self) -> str:
        return self._request_id

    @property
    def stream(self) -> bool:
        return self._stream

    async def admitted(self) -> None:
        """Return once the owner accepted the request; raise the 4xx it answered otherwise. A
        whole answer is the owner's verdict too, so `response` raises it instead."""
        if not self._stream or self._after > 0:  # events exist only after an admission
            return
        async for entries in self._steps(0):
            _, fields = entries[0]
            if BODY in fields:
                raise _stored_error(fields[BODY])
            return

    async def events(
        self,
        coalesce_s: float = 0.0,
        events_per_write: EventsPerWrite | None = None,
        write_now: WriteNow | None = None,
    ) -> AsyncIterator[bytes]:
        """SSE bytes after the resume point until [DONE]; an error event if that cannot be.
        The store hands events over in reads of their own, so neither `events_per_write` nor
        `write_now` is used."""
        self._metrics.stream_started()
        cursor = self._after
        try:
            async for entries in self._steps(cursor):
                frames = []
                for sequence, fields in entries:
                    if sequence != cursor + 1:
                        yield error_frames(EventsGone(f"events after {cursor} are no longer held"))
                        return
                    cursor = sequence
                    data = fields[DATA]
                    frames.append(sse_event(sequence, data) if self._numbered else sse_data(data))
                    if data == DONE_DATA:
                        yield b"".join(frames)
                        return
                yield b"".join(frames)
        except BundleError as error:  # the owner died, or the store went away mid-stream
            yield error_frames(error)
        finally:
            self._metrics.stream_ended()

    async def response(self) -> dict[str, Any]:
        """Wait for the owner's whole answer and return it as it returned it (or raise its error)."""
        async for entries in self._steps(0):
            for _, fields in entries:
                if BODY in fields:
                    answer = orjson.loads(fields[BODY])
                    if answer["status"] != 200:
                        raise StoredError(int(answer["status"]), answer["body"])
                    return dict(answer["body"])
        raise EventsGone("the stored answer is gone")  # unreachable: _steps raises or yields

    async def _steps(self, after: int) -> AsyncIterator[list[tuple[int, dict[bytes, bytes]]]]:
        """Batches of entries after `after`; raises ProducerLost or EventsGone rather than hang."""
        checked = 0.0
        idle = True  # check the owner on the first read
        while True:
            check = idle or time.monotonic() - checked >= CHECK_EVERY_S
            step = await self._store.read(self._request_id, after, self._owner if check else None)
            if check:
                checked = time.monotonic()
            if step.entries:
                idle = False
                after = step.entries[-1][0]
                yield step.entries
                continue
            idle = True
            if step.state is not None and step.state != RUNNING:
                # Ended, and still nothing after `after`: the end was not stored (store outage).
                raise EventsGone(f"events after {after} of this finished request are no longer held")
            if step.owner_alive is False:
                raise ProducerLost(
                    f"the replica running X-Request-Id {self._request_id!r} stopped (no heartbeat "
                    f"for {PRODUCER_LOST_BOUND_S:g} s); start again with a new X-Request-Id"
                )
            if check and step.state is None:
                # The claim is gone: it expired (past the longest generation plus the retention:
                # its end was never stored) or was released (refused after the claim). No more
                # events can come for it.
                raise EventsGone(f"events after {after} of this request are no longer held")

    @property
    def usage(self) -> Usage:
        """The counts the owner reported, once `text` has read them (zero before)."""
        return self._usage

    async def text(self) -> AsyncIterator[str]:
        """The generated text from the start (the Cog runner's view, a prediction whose
        request_id another replica runs): re-read from the owner's stream, or, for a request that
        does not stream (the runner's own), its whole answer at once when the owner has it: the
        store holds no pieces of such a generation. Raises the owner's error."""
        if not self._stream:
            answer = await self.response()
            self._usage = _usage_of(answer)
            if text := _answer_text(answer):
                yield text
            return
        cursor = 0
        async for entries in self._steps(cursor):
            for sequence, fields in entries:
                if sequence != cursor + 1:
                    raise EventsGone(f"events after {cursor} are no longer held")
                cursor = sequence
                if fields[DATA] == DONE_DATA:
                    return
                if piece := self._take_chunk(orjson.loads(fields[DATA])):
                    yield piece

    def _take_chunk(self, chunk: dict[str, Any]) -> str:
        """One stored chunk's text; its usage, if it carries one; its error, raised."""
        if "error" in chunk:
            raise StoredError(GENERATION_ERROR_STATUS, chunk)
        if chunk.get("usage"):
            self._usage = _usage_of(chunk)
        return "".join(_choice_text(choice) for choice in chunk.get("choices") or ())

    def close(self) -> None:
        """Nothing to release: presence elsewhere lapses by itself when reads stop."""

    def abandon(self) -> None:
        self.close()


def _usage_of(answer: dict[str, Any]) -> Usage:
    usage = answer.get("usage") or {}
    return Usage(int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0)))


def _answer_text(answer: dict[str, Any]) -> str:
    return "".join(_choice_text(choice) for choice in answer.get("choices") or ())


def _choice_text(choice: dict[str, Any]) -> str:
    """A choice's text: a completion's `text`, a chat message's or a chat delta's `content`."""
    if "text" in choice:
        return str(choice["text"] or "")
    message = choice.get("delta") or choice.get("message") or {}
    return str(message.get("content") or "")


def _stored_error(raw: bytes) -> StoredError:
    answer = orjson.loads(raw)
    return StoredError(int(answer["status"]), answer["body"])
