"""Request identity: which generation an `X-Request-Id` means, who reads it, and how long it lives.

The registry is the only place that starts or aborts generations. It guarantees:
- one id, one engine generation (duplicates attach, finished ones replay);
- bounded memory (finished results expire after `retention_s` and beyond `max_held_requests`,
  oldest first; running generations are never evicted while anyone may still read them);
- no orphans: a generation nobody reads is aborted, at once when anonymous, after the
  disconnect grace window when it has an id a client can come back with.

Readers hold a `LocalSubscription`, which `Service.open` hands to the wrappers: the events or text to
follow, and a `close` that detaches (the last reader leaving starts the grace window).
"""

from __future__ import annotations

import asyncio
import functools
import sys
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from shared.errors import Cancelled, IdempotencyConflict, NotFound, Overloaded, abort_error
from shared.generation.output import HANDOFF, GenerationOutput
from shared.generation.replay import EventsPerWrite, WriteNow
from shared.obs.metrics import Metrics
from shared.settings import Settings
from shared.streaming import Usage

Producer = Callable[[GenerationOutput, Callable[[], str]], Coroutine[Any, Any, None]]


@dataclass(eq=False)
class Entry:
    """The lifecycle record of one generation; only the registry writes it."""

    request_id: str | None  # the client's X-Request-Id; None: anonymous, not resumable
    fingerprint: str | None  # of the request body; None when request_id is None
    output: GenerationOutput
    subscribers: int = 0
    abort_reason: str = "cancelled"
    task: asyncio.Task[None] | None = None
    grace_timer: asyncio.TimerHandle | None = field(default=None, repr=False)


@dataclass(frozen=True)
class CancelOutcome:
    request_id: str
    # "cancelled": aborted (now or before); "completed"/"failed": it had already ended that way;
    # "cancelling": aborted, but not yet stopped within the wait.
    status: str


class LocalSubscription:
    """One reader of a generation this replica runs (or ran): `shared.generation.subscription.Subscription`."""

    def __init__(self, registry: Registry, entry: Entry, after: int, metrics: Metrics) -> None:
        self._registry = registry
        self._entry = entry
        self._after = after
        self._metrics = metrics
        self._closed = False

    @property
    def request_id(self) -> str | None:
        return self._entry.request_id

    @property
    def stream(self) -> bool:
        return self._entry.output.stream

    async def admitted(self) -> None:
        """Return once the request passed every check and may reach the engine; raise its 4xx
        otherwise. Call before sending a status line: bad input must never be a 200."""
        await self._entry.output.admission()

    async def events(
        self,
        coalesce_s: float = 0.0,
        events_per_write: EventsPerWrite | None = None,
        write_now: WriteNow | None = None,
    ) -> AsyncIterator[bytes]:
        """SSE bytes after the resume point, live until the end; closes the subscription after.
        Chunks that `write_now` put on the connection itself are not yielded (replay.py)."""
        self._metrics.stream_started()
        follow = self._entry.output.events.follow
        try:
            async for chunk in follow(self._after, coalesce_s, events_per_write, write_now):
                yield chunk
        finally:
            # Runs on normal end, on disconnect (cancellation) and on send failures alike.
            self._metrics.stream_ended()
            self.close()

    @property
    def usage(self) -> Usage:
        """Prompt and generated token counts so far (final once the generation ended)."""
        return self._entry.output.usage

    def text(self) -> AsyncIterator[str]:
        """The generated text from the start, in pieces as it grows (the Cog runner's view)."""
        return self._entry.output.follow_text()

    async def response(self) -> dict[str, Any]:
        """Wait for the end and return the whole non-streaming body (raises its error)."""
        await self._entry.output.wait()
        return self._entry.output.response()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._registry.detach(self._entry)

    def abandon(self) -> None:
        """The reader stops early and will not come back: close, and abort the generation unless
        another reader still follows it (two Cog predictions with one request_id share it)."""
        last_reader = not self._closed and self._entry.subscribers == 1
        self.close()
        if last_reader:
            self._registry.abort(self._entry, "cancelled")


class Registry:
    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self._settings = settings
        self._metrics = metrics
        self._held: dict[str, Entry] = {}  # by X-Request-Id, running or finished
        self._finished: OrderedDict[str, Entry] = OrderedDict()  # eviction order
        self._running: set[Entry] = set()
        # With a shared store (shared/replicas/replicated.py): seconds that readers on other replicas still
        # hold a generation whose grace window ran out here; 0 means none, abort.
        self.followers_elsewhere: Callable[[Entry], Awaitable[float]] | None = None
        self._rechecks: set[asyncio.Task[None]] = set()

    @property
    def running(self) -> int:
        """Generations running on this replica now (the load `stream_batch_at` responds to)."""
        return len(self._running)

    # --- lookup -----------------------------------------------------------------------------
    def find(self, request_id: str, fingerprint: str) -> Entry | None:
        """The generation this id already names, or None. A different body is a conflict."""
        self._evict()
        entry = self._held.get(request_id)
        if entry is not None and entry.fingerprint != fingerprint:
            raise IdempotencyConflict(
                f"X-Request-Id {request_id!r} was already used with a different request body",
                param="X-Request-Id",
            )
        return entry

    # --- lifecycle --------------------------------------------------------------------------
    def start(self, entry: Entry, producer: Producer) -> None:
        """Admit a new generation (or refuse with 429) and start its producer task."""
        if len(self._running) >= self._settings.max_in_flight:
            self._metrics.rejected_requests.labels("429").inc()
            raise Overloaded(
                f"{len(self._running)} generations in flight (cap {self._settings.max_in_flight})",
                retry_after_s=self._settings.retry_after_s,
            )
        if entry.request_id is not None:
            self._held[entry.request_id] = entry
        self._running.add(entry)
        entry.task = start_eagerly(self._drive(entry, producer))
        entry.task.add_done_callback(functools.partial(self._ended_unstarted, entry))

    async def _drive(self, entry: Entry, producer: Producer) -> None:
        try:
            await producer(entry.output, lambda: entry.abort_reason)
        finally:
            self._ended(entry)

    def _ended_unstarted(self, entry: Entry, _: asyncio.Task[None]) -> None:
        """Before Python 3.12 a task starts on the next loop turn, so an abort in between cancels
        a coroutine that never ran: `_drive`'s clean-up did not run either (had it, the entry
        would have left `_running`). Its readers get their end here, and its slot is freed."""
        if entry not in self._running:
            return
        self._metrics.aborted_requests.labels(entry.abort_reason).inc()
        error = abort_error(entry.abort_reason)
        if entry.abort_reason == HANDOFF:
            entry.output.hand_off()
        elif entry.output.accepted:
            entry.output.finish(error)
        else:
            entry.output.reject(error)
        self._ended(entry)

    def _ended(self, entry: Entry) -> None:
        self._running.discard(entry)
        self._cancel_grace(entry)
        if entry.request_id is not None:
            self._finished[entry.request_id] = entry
        self._evict()

    def subscribe(self, entry: Entry, after: int = 0) -> LocalSubscription:
        entry.subscribers += 1
        self._cancel_grace(entry)
        return LocalSubscription(self, entry, after, self._metrics)

    def unattended(self, entry: Entry) -> None:
        """A generation started with no reader here (a takeover for readers on other replicas):
        its grace window runs now, as if its last reader had just left."""
        if not entry.subscribers and not entry.output.done and entry.request_id is not None:
            self._arm_grace(entry, self._settings.disconnect_grace_s)

    def runs(self, request_id: str) -> bool:
        """Whether this replica runs the generation `request_id` names right now."""
        entry = self._held.get(request_id)
        return entry is not None and entry in self._running

    def running_with_id(self) -> list[Entry]:
        """Running generations a client can name (and come back to)."""
        return [entry for entry in self._running if entry.request_id is not None]

    def detach(self, entry: Entry) -> None:
        entry.subscribers -= 1
        if entry.subscribers > 0 or entry.output.done:
            return
        if entry.request_id is None:
            self.abort(entry, "disconnect")  # nobody can ever come back for it
        else:
            self._arm_grace(entry, self._settings.disconnect_grace_s)

    def _arm_grace(self, entry: Entry, delay_s: float) -> None:
        entry.grace_timer = asyncio.get_running_loop().call_later(delay_s, self._grace_over, entry)

    def _grace_over(self, entry: Entry) -> None:
        entry.grace_timer = None
        if self.followers_elsewhere is None:
            self.abort(entry, "grace_expired")
            return
        task = asyncio.get_running_loop().create_task(self._recheck_grace(entry, self.followers_elsewhere))
        self._rechecks.add(task)
        task.add_done_callback(self._rechecks.discard)

    async def _recheck_grace(self, entry: Entry, elsewhere: Callable[[Entry], Awaitable[float]]) -> None:
        more_s = await elsewhere(entry)
        if entry.subscribers or entry.output.done or entry.grace_timer is not None:
            return  # a reader came back here meanwhile
        if more_s > 0:
            self._arm_grace(entry, more_s)
        else:
            self.abort(entry, "grace_expired")

    def abort(self, entry: Entry, reason: str) -> None:
        if entry.output.done or entry.task is None:
            return
        entry.abort_reason = reason
        entry.task.cancel()

    async def cancel(self, request_id: str, wait_s: float) -> CancelOutcome:
        """Abort the generation this id names; wait (bounded) until it has stopped."""
        entry = self._held.get(request_id)
        if entry is None:
            raise NotFound(f"no request with id {request_id!r} is held", param="request_id")
        if entry.output.done:
            return CancelOutcome(request_id, final_status(entry))
        self.abort(entry, "cancelled")
        if entry.task is not None:
            await asyncio.wait({entry.task}, timeout=wait_s)
        status = final_status(entry) if entry.output.done else "cancelling"
        return CancelOutcome(request_id, status)

    async def shutdown(self) -> None:
        tasks = [e.task for e in self._running if e.task is not None]
        for entry in list(self._running):
            self.abort(entry, "shutdown")
        await asyncio.gather(*tasks, return_exceptions=True)

    # --- bounds -----------------------------------------------------------------------------
    def _cancel_grace(self, entry: Entry) -> None:
        if entry.grace_timer is not None:
            entry.grace_timer.cancel()
            entry.grace_timer = None

    def _evict(self) -> None:
        """Drop finished results past retention or beyond the cap, oldest first: O(evicted)."""
        horizon = time.monotonic() - self._settings.retention_s
        for _ in range(len(self._finished)):
            request_id, oldest = next(iter(self._finished.items()))
            over_cap = len(self._held) > self._settings.max_held_requests
            if not over_cap and (oldest.output.finished_at or 0.0) >= horizon:
                return
            del self._finished[request_id]
            if oldest.subscribers:  # someone is reading its replay right now: keep it a bit
                self._finished[request_id] = oldest
                continue
            del self._held[request_id]

    def stats(self) -> dict[str, int]:
        return {
            "held_requests": len(self._held),
            "running_generations": len(self._running),
            "held_events": sum(e.output.events.held_events() for e in self._held.values()),
            "subscribers": sum(e.subscribers for e in self._held.values()),
        }


def final_status(entry: Entry) -> str:
    error = entry.output.error
    if error is None:
        return "completed"
    return "cancelled" if isinstance(error, Cancelled) else "failed"


def start_eagerly(work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    """A task whose first steps run now, inside the caller, up to its first real wait.

    Under a burst of requests, a task created the usual way runs only after the loop has turned
    to every other request already waiting to be parsed, so each engine request is queued late
    and the whole burst's time to first token grows. Started eagerly, a generation's engine
    request is sent before the next request is read. Python 3.12 has it (the deploy images run
    3.12); older interpreters start the task on the next loop turn.
    """
    loop = asyncio.get_running_loop()
    if sys.version_info >= (3, 12):
        return asyncio.Task(work, loop=loop, eager_start=True)  # type: ignore[call-arg]
    return loop.create_task(work)
