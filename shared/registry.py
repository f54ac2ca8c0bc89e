"""Request identity: which generation an `X-Request-Id` means, and how long it lives.

The registry is the only place that starts or aborts generations. It guarantees:
- one id, one engine generation (duplicates attach, finished ones replay);
- bounded memory (finished results expire after `retention_s` and beyond `max_held_requests`,
  oldest first; running generations are never evicted while anyone may still read them);
- no orphans: a generation nobody reads is aborted, at once when anonymous, after the
  disconnect grace window when it has an id a client can come back with.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from typing import Any

from shared.errors import IdempotencyConflict, NotFound, Overloaded
from shared.generation import Generation
from shared.metrics import Metrics
from shared.settings import Settings

Producer = Callable[[Generation], Coroutine[Any, Any, None]]


class Registry:
    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self._settings = settings
        self._metrics = metrics
        self._held: dict[str, Generation] = {}  # by X-Request-Id, running or finished
        self._finished: OrderedDict[str, Generation] = OrderedDict()  # eviction order
        self._running: set[Generation] = set()

    # --- lookup -----------------------------------------------------------------------------
    def find(self, request_id: str, fingerprint: str) -> Generation | None:
        """The generation this id already names, or None. A different body is a conflict."""
        self._evict()
        generation = self._held.get(request_id)
        if generation is not None and generation.fingerprint != fingerprint:
            raise IdempotencyConflict(
                f"X-Request-Id {request_id!r} was already used with a different request body",
                param="X-Request-Id",
            )
        return generation

    # --- lifecycle --------------------------------------------------------------------------
    def start(self, generation: Generation, producer: Producer) -> None:
        """Admit a new generation (or refuse with 429) and start its producer task."""
        if len(self._running) >= self._settings.max_in_flight:
            self._metrics.rejected_requests.labels("429").inc()
            raise Overloaded(
                f"{len(self._running)} generations in flight (cap {self._settings.max_in_flight})",
                retry_after_s=self._settings.retry_after_s,
            )
        if generation.request_id is not None:
            self._held[generation.request_id] = generation
        self._running.add(generation)
        generation.task = asyncio.create_task(self._drive(generation, producer))

    async def _drive(self, generation: Generation, producer: Producer) -> None:
        try:
            await producer(generation)
        finally:
            self._running.discard(generation)
            self._cancel_grace(generation)
            if generation.request_id is not None:
                self._finished[generation.request_id] = generation
            self._evict()

    def attach(self, generation: Generation) -> None:
        generation.subscribers += 1
        self._cancel_grace(generation)

    def detach(self, generation: Generation) -> None:
        generation.subscribers -= 1
        if generation.subscribers > 0 or generation.done:
            return
        if generation.request_id is None:
            self.abort(generation, "disconnect")  # nobody can ever come back for it
        else:
            loop = asyncio.get_running_loop()
            generation.grace_timer = loop.call_later(
                self._settings.disconnect_grace_s, self.abort, generation, "grace_expired"
            )

    def abort(self, generation: Generation, reason: str) -> None:
        if generation.done or generation.task is None:
            return
        generation.abort_reason = reason
        generation.task.cancel()

    def cancel(self, request_id: str) -> Generation:
        generation = self._held.get(request_id)
        if generation is None:
            raise NotFound(f"no request with id {request_id!r} is held", param="request_id")
        self.abort(generation, "cancelled")
        return generation

    async def shutdown(self) -> None:
        tasks = [g.task for g in self._running if g.task is not None]
        for generation in list(self._running):
            self.abort(generation, "shutdown")
        await asyncio.gather(*tasks, return_exceptions=True)

    # --- bounds -----------------------------------------------------------------------------
    def _cancel_grace(self, generation: Generation) -> None:
        if generation.grace_timer is not None:
            generation.grace_timer.cancel()
            generation.grace_timer = None

    def _evict(self) -> None:
        """Drop finished results past retention or beyond the cap, oldest first: O(evicted)."""
        horizon = time.monotonic() - self._settings.retention_s
        for _ in range(len(self._finished)):
            request_id, oldest = next(iter(self._finished.items()))
            over_cap = len(self._held) > self._settings.max_held_requests
            if not over_cap and (oldest.finished_at or 0.0) >= horizon:
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
            "held_events": sum(len(g.events) for g in self._held.values()),
            "subscribers": sum(g.subscribers for g in self._held.values()),
        }
