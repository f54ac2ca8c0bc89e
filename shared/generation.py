"""One engine generation, shared by every client that asks for it.

A `Generation` is driven by exactly one background task (`produce`) that pulls deltas from the
engine and appends SSE events to a bounded replay buffer. Clients never touch the engine: they
`follow` the buffer from an event id, so attaching a duplicate, resuming after a dropped
connection and replaying a finished result are all the same operation. A reader that falls
behind receives its backlog in one write, which coalesces tokens under load for free.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from shared.engine import Engine, SamplingRequest
from shared.errors import BundleError, Cancelled, EventsGone, GenerationFailed, InvalidRequest
from shared.metrics import Metrics
from shared.streaming import DONE_DATA, ChunkEncoder, Usage, error_data, sse_event

log = logging.getLogger(__name__)


class Generation:
    def __init__(
        self,
        *,
        request_id: str | None,
        fingerprint: str | None,
        encoder: ChunkEncoder,
        stream: bool,
        include_usage: bool,
        prompt_tokens: int,
        max_events: int,
    ) -> None:
        self.request_id = request_id  # the client's X-Request-Id; None: anonymous, not resumable
        self.fingerprint = fingerprint  # of the request body; None when request_id is None
        self.encoder = encoder
        self.stream = stream
        self.include_usage = include_usage
        self.usage = Usage(prompt_tokens)
        self.max_events = max_events
        self.events: list[bytes] = []
        self.first_sequence = 1  # sequence number of events[0]; grows as old events are dropped
        self.next_sequence = 1
        self.text_parts: list[str] = []
        self.finish_reason: str | None = None
        self.error: BundleError | None = None
        self.done = False
        self.finished_at: float | None = None
        self.subscribers = 0
        self.abort_reason = "cancelled"
        self.task: asyncio.Task[None] | None = None
        self.grace_timer: asyncio.TimerHandle | None = None
        self._waiter: asyncio.Future[None] | None = None  # made only when a reader waits

    # --- writing (the producer task only) ----------------------------------------------------
    def emit(self, data: bytes) -> None:
        if not self.stream:
            return
        self.events.append(sse_event(self.next_sequence, data))
        self.next_sequence += 1
        overflow = len(self.events) - self.max_events
        if overflow > 0:
            # Drop a quarter at once so trimming is amortised O(1) per event.
            drop = max(overflow, self.max_events // 4)
            del self.events[:drop]
            self.first_sequence += drop
        self._wake()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _changed(self) -> None:
        """Wait for the next event or the end. One shared future per wake-up: cheaper than an
        asyncio.Event per event on the per-token path (profiled), and none at all when nobody
        is waiting. Callers re-check state after waking, so a spurious wake-up is harmless."""
        if self._waiter is None or self._waiter.done():
            self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        except asyncio.CancelledError:
            # Awaiting a shared future: a cancelled reader cancels it for everyone. Only the
            # reader that is itself being cancelled re-raises; the others just wake up.
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise

    def on_delta(self, text: str, token_count: int, finish_reason: str | None) -> None:
        self.usage.completion_tokens += token_count
        if finish_reason is not None:
            self.finish_reason = finish_reason
        if text:
            self.text_parts.append(text)
            if not self.stream:
                self._wake()  # follow_text readers (Cog) want each piece as it comes
        if self.stream and (text or finish_reason is not None):
            self.emit(self.encoder.text(text, finish_reason))

    def finish(self, error: BundleError | None = None) -> None:
        if self.done:
            return
        self.error = error
        if error is not None:
            self.emit(error_data(error))
        elif self.include_usage:
            self.emit(self.encoder.usage(self.usage))
        self.emit(DONE_DATA)
        self.done = True
        self.finished_at = time.monotonic()
        self._wake()

    # --- reading (any number of clients) ---------------------------------------------------
    def check_resumable(self, last_event_id: int) -> None:
        """Refuse before any byte is sent if a resume cannot be served without a gap."""
        if last_event_id + 1 < self.first_sequence:
            raise EventsGone(
                f"events after {last_event_id} are no longer held (oldest held: "
                f"{self.first_sequence}); restart the request with a new X-Request-Id"
            )
        if last_event_id >= self.next_sequence and self.done:
            raise InvalidRequest(f"Last-Event-ID {last_event_id} is beyond the end of this stream")

    async def follow(self, last_event_id: int, coalesce_s: float = 0.0) -> AsyncIterator[bytes]:
        """Yield every event after `last_event_id`, then live ones until the stream ends."""
        cursor = last_event_id + 1
        while True:
            if cursor < self.first_sequence:
                # This reader fell further behind than the buffer holds: say so and stop.
                gone = EventsGone("this reader fell behind and events were dropped")
                yield b"data: %s\n\ndata: [DONE]\n\n" % error_data(gone)
                return
            if cursor < self.next_sequence:
                backlog = self.events[cursor - self.first_sequence :]
                cursor = self.next_sequence
                yield backlog[0] if len(backlog) == 1 else b"".join(backlog)
                continue
            if self.done:
                return
            await self._changed()
            if coalesce_s:
                await asyncio.sleep(coalesce_s)

    async def follow_text(self) -> AsyncIterator[str]:
        """Yield the generated text piece by piece from the start; raise if it failed.

        For wrappers that want plain text rather than SSE (the Cog runner)."""
        cursor = 0
        while True:
            if cursor < len(self.text_parts):
                pieces = self.text_parts[cursor:]
                cursor += len(pieces)
                for piece in pieces:
                    yield piece
                continue
            if self.done:
                if self.error is not None:
                    raise self.error
                return
            await self._changed()

    async def wait(self) -> None:
        while not self.done:
            await self._changed()

    def response(self) -> dict[str, Any]:
        """The non-streaming body; raises the generation's error if it failed."""
        if self.error is not None:
            raise self.error
        return self.encoder.response("".join(self.text_parts), self.finish_reason, self.usage)


async def produce(
    generation: Generation,
    engine: Engine,
    request: SamplingRequest,
    metrics: Metrics,
    timeout_s: float,
    engine_request_id: str,
) -> None:
    """The one task that drives a generation. Cancelling it aborts the engine request."""
    metrics.engine_generations.inc()
    metrics.prompt_tokens.inc(generation.usage.prompt_tokens)
    metrics.running_generations.inc()
    metrics.queued_requests.inc()
    waiting_for_first = True
    started = last = time.perf_counter()
    opening = generation.encoder.opening()
    if opening is not None:
        generation.emit(opening)
    try:
        async with asyncio.timeout(timeout_s):
            async for delta in engine.generate(engine_request_id, request):
                now = time.perf_counter()
                if waiting_for_first:
                    metrics.time_to_first_token.observe(now - started)
                    metrics.queued_requests.dec()
                    waiting_for_first = False
                elif delta.token_count:
                    metrics.inter_token_latency.observe((now - last) / delta.token_count)
                last = now
                metrics.generation_tokens.inc(delta.token_count)
                generation.on_delta(delta.text, delta.token_count, delta.finish_reason)
        generation.finish()
    except asyncio.CancelledError:
        # We cancel this task ourselves to abort (disconnect, grace expiry, cancel, shutdown);
        # vLLM's generator has already aborted the engine request on its way out.
        metrics.aborted_requests.labels(generation.abort_reason).inc()
        generation.finish(Cancelled(f"generation aborted: {generation.abort_reason}"))
    except TimeoutError:
        metrics.aborted_requests.labels("timeout").inc()
        generation.finish(GenerationFailed(f"generation exceeded {timeout_s:g} s"))
    except BundleError as exc:
        generation.finish(exc)
    except Exception as exc:  # never leave readers hanging on an unexpected failure
        log.exception("generation failed")
        generation.finish(GenerationFailed(f"generation failed: {type(exc).__name__}"))
    finally:
        if waiting_for_first:
            metrics.queued_requests.dec()
        metrics.running_generations.dec()
