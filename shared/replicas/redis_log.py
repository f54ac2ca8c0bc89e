"""The owner's side of a generation's event log in the shared store: the writer of every stream
this replica owns, and the `EventLog` of each generation it runs.

- `StreamWriter` batches the appends of every stream this replica owns: all events queued while
  one pipeline is in flight go out in the next, so hundreds of streams cost one round trip per
  flush, not one per token.
- `SharedLog` is the owner's `EventLog`: its own readers keep following the in-memory buffer;
  each event is also queued for the shared stream with its sequence number.

Readers on other replicas: shared/replicas/remote_subscription.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from shared.errors import StoreUnavailable
from shared.generation.replay import EventsPerWrite, ReplayBuffer, WriteNow
from shared.replicas.store import DATA, RECONNECT_S, TEXT, AppendBatch, Claim, IdentityStore
from shared.replicas.tokens import pack_ids

log = logging.getLogger(__name__)


class Guard(Protocol):
    """What a writer reports to the log of one generation it writes for (`SharedLog`)."""

    @property
    def claim(self) -> bytes:
        """The claim this replica holds for the generation, as stored: writes are fenced by it."""
        ...

    def written(self, upto: int) -> None:
        """Its entries up to sequence `upto` are in the store (or were given up in an outage)."""
        ...

    def lost(self) -> None:
        """Another replica holds its claim now: nothing of it was or will be written."""
        ...


@dataclass
class _Group:
    """One generation's share of a flush."""

    recipe: bytes = b""
    kind: bytes = DATA  # the field its entries go under: DATA (a stream's events) or TEXT
    events: list[tuple[int, bytes, bytes]] = field(default_factory=list)  # sequence, data, ids
    kept: str = ""  # carried by its first event (a takeover's first entry)
    final: tuple[Claim, bytes | None, int, int] | None = None  # claim, answer, its sequence, TTL (ms)


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
        self._groups: dict[str, _Group] = {}
        self._guards: dict[str, Guard] = {}
        self._new_streams: set[str] = set()
        self._flusher: asyncio.Task[None] | None = None
        self._failing = False

    def guard(self, request_id: str, guard: Guard) -> None:
        """Fence the writes of `request_id` by the guard's claim, and report to it (`Guard`)."""
        self._guards[request_id] = guard

    def record(self, request_id: str, recipe: bytes) -> None:
        """What a takeover needs to continue it, written before its first entry."""
        self._group(request_id).recipe = recipe
        self._kick()

    def append(
        self, request_id: str, sequence: int, data: bytes, ids: bytes = b"", kind: bytes = DATA, kept: str = ""
    ) -> None:
        group = self._group(request_id)
        if kept:  # a takeover's first entry: no earlier one of this id can share its flush
            group.kept = kept
        group.kind = kind
        group.events.append((sequence, data, ids))
        self._kick()

    def finish(
        self,
        request_id: str,
        claim: Claim,
        body: bytes | None,
        sequence: int = 1,
        *,
        running: bool = False,
    ) -> None:
        """The end: the final claim state (and a non-streaming answer, under `sequence`), after
        all its events. `running`: the claim is handed over, not ended (its keys keep the
        running TTL)."""
        ttl = self._running_ttl_ms if running else self._retention_ms
        self._group(request_id).final = (claim, body, sequence, ttl)
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

    def _group(self, request_id: str) -> _Group:
        group = self._groups.get(request_id)
        if group is None:
            group = self._groups[request_id] = _Group()
        return group

    def _kick(self) -> None:
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        while True:
            # At least one loop turn before each write: every producer woken in this turn (or
            # in this window) queues its events first.
            await asyncio.sleep(self._window_s)
            if not self._groups:
                return
            groups, self._groups = self._groups, {}
            try:
                lost = await self._store.append(self._batch(groups))
            except Exception as error:  # any failure to write is handled as an outage
                if not isinstance(error, StoreUnavailable):  # a client fault, not a refused connection
                    log.exception("writing shared streams failed unexpectedly; handled as an outage")
                # Counted in /metrics; logged once per outage. Followers see the gap in sequence
                # numbers and say so (a takeover refuses such a log); the owner's own readers get
                # the events all the same. The ends are kept and written once the store answers:
                # without its end a stream's claim would say "running" until it expires, and
                # readers elsewhere would wait that long.
                if not self._failing:
                    log.warning("store unavailable: events of shared streams are being dropped")
                self._failing = True
                self._report(groups, lost=())
                self._keep_finals(groups)
                await asyncio.sleep(RECONNECT_S)
            else:
                self._failing = False
                self._report(groups, lost=lost)

    def _report(self, groups: dict[str, _Group], lost: Sequence[str]) -> None:
        for request_id in lost:
            self._new_streams.discard(request_id)
            guard = self._guards.pop(request_id, None)
            if guard is not None:
                guard.lost()
        for request_id, group in groups.items():
            guard = self._guards.get(request_id)
            if guard is not None and group.events and request_id not in lost:
                guard.written(group.events[-1][0])
            if group.final is not None and request_id not in lost and not self._failing:
                self._guards.pop(request_id, None)

    def _keep_finals(self, groups: dict[str, _Group]) -> None:
        for request_id, group in groups.items():
            if group.final is not None:
                kept = self._group(request_id)
                kept.final = kept.final or group.final

    def _batch(self, groups: dict[str, _Group]) -> AppendBatch:
        """The flush as APPEND_SCRIPT's arguments (see shared/replicas/store.py)."""
        batch = AppendBatch(args=[self._max_events, self._running_ttl_ms, len(groups)])
        args = batch.args
        for request_id, group in groups.items():
            guard = self._guards.get(request_id)
            batch.groups.append(request_id)
            events = group.events
            new = bool(events) and request_id not in self._new_streams
            if new:
                self._new_streams.add(request_id)
            first = events[0][0] if events else 0
            final = group.final
            header = (
                f"{first} {len(events)} {int(new)} {group.kind.decode()} "
                f"{int(bool(group.recipe))} {int(bool(group.kept))} {int(final is not None)}"
            )
            args += [request_id, guard.claim if guard is not None else b"", header]
            for _, data, ids in events:
                args += [data, ids]
            if group.recipe:
                args.append(group.recipe)
            if group.kept:
                args.append(group.kept)
            batch.commands += len(events) + int(new) + int(guard is not None) + int(bool(group.recipe))
            if final is not None:
                claim, body, sequence, ttl = final
                args += [claim.encode(), body or b"", sequence, ttl]
                self._new_streams.discard(request_id)
                batch.commands += 4 if body is not None else 3
        return batch


class SharedLog:
    """`EventLog` of a generation this replica owns: memory first, the shared stream behind.

    With `write_ahead` (takeover on), an event reaches this replica's own readers only once the
    store holds it: a client never has an event that a replica taking the generation over
    cannot see, so its Last-Event-ID always names a logged event. Each entry also carries the
    token ids whose text it holds (`tokens`, from the generation's output), and the log's
    writes are fenced by this replica's claim: once another replica took the generation over,
    nothing more of it is written, and `on_lost` stops it here."""

    def __init__(
        self,
        local: ReplayBuffer,
        writer: StreamWriter,
        request_id: str,
        *,
        claim: Claim | None = None,
        write_ahead: bool = False,
        on_lost: Callable[[], None] = lambda: None,
        kept: int | None = None,
    ) -> None:
        self._local = local
        self._writer = writer
        self._request_id = request_id
        self.holder = claim  # the claim this replica holds for it (None: writes are not fenced)
        self._claim = claim.encode() if claim is not None else b""
        self._write_ahead = write_ahead
        self._on_lost = on_lost
        self._kept = kept  # the first entry says how many ids logged before it were kept
        self._next = local.next_sequence
        self._ids: list[int] = []  # ids of deltas whose text has not gone out in an entry yet
        self._held: deque[bytes] = deque()  # appended, not yet in the store (write-ahead)
        self._closing = False
        self.taken_over = False  # another replica holds the claim now: this one writes nothing more
        if claim is not None:
            writer.guard(request_id, self)

    @property
    def claim(self) -> bytes:
        return self._claim

    @property
    def numbered(self) -> bool:
        """Whether the events carry `id:` lines (the creator's framing, which followers copy)."""
        return self._local.numbered

    @property
    def next_sequence(self) -> int:
        """The sequence the next entry of this generation gets (its answer's, if it ends)."""
        return self._next

    @property
    def closed(self) -> bool:
        return self._local.closed

    @closed.setter
    def closed(self, value: bool) -> None:
        self._local.closed = value

    # --- the producer's side -------------------------------------------------------------------
    def tokens(self, ids: Sequence[int]) -> None:
        """Token ids the engine produced; they go into the next entry that carries text."""
        self._ids.extend(ids)

    def text(self, piece: str) -> None:
        """A text piece of a non-streaming generation (a takeover rebuilds its answer from them)."""
        self._write(TEXT, piece.encode())

    def append(self, data: bytes) -> None:
        if not self._write(DATA, data):
            return
        if self._write_ahead:
            self._held.append(data)
        else:
            self._local.append(data)

    def _write(self, kind: bytes, data: bytes) -> bool:
        if self.taken_over:
            return False
        sequence = self._next
        self._next += 1
        ids = pack_ids(self._ids) if self._ids else b""
        self._ids = []
        kept = "" if self._kept is None else str(self._kept)
        self._kept = None
        self._writer.append(self._request_id, sequence, data, ids, kind, kept)
        return True

    def close(self) -> None:
        if self._held:
            self._closing = True  # once the store has the last events (`written`)
            return
        self._local.close()

    # --- the writer's reports (`Guard`) ---------------------------------------------------------
    def written(self, upto: int) -> None:
        first_held = self._next - len(self._held)
        for _ in range(min(upto - first_held + 1, len(self._held))):
            self._local.append(self._held.popleft())
        if self._closing and not self._held:
            self._local.close()

    def lost(self) -> None:
        """Another replica took the generation over (this one was paused, or cut off from the
        store, past its heartbeat): what is held never reaches a reader, and the generation stops.
        Its readers here see the stream end without [DONE], and resume where it goes on."""
        self.taken_over = True
        self._held.clear()
        self._local.close()
        self._on_lost()

    # --- readers -------------------------------------------------------------------------------
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
