"""One engine generation's output, shared by every client that asks for it.

`produce` is the one task that pulls deltas from the engine and writes them into a
`GenerationOutput`: SSE events into its `EventLog` (streams), text pieces and usage (the
non-streaming body, and the Cog runner's plain text). Readers never touch the engine. Who may
read, for how long, and when to abort is the registry's business, not this module's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

from shared.engine.contract import EngineDelta
from shared.errors import BundleError, GenerationFailed, ShuttingDown, abort_error
from shared.generation.replay import EventLog, Notifier
from shared.obs.metrics import Metrics
from shared.obs.request_traces import GenerationTrace
from shared.shaping.choices import Choices
from shared.streaming import DONE_DATA, ChunkEncoder, Usage, error_data

log = logging.getLogger(__name__)

# The abort reason of a generation handed over at shutdown: it goes on on another replica.
HANDOFF = "handoff"
HANDED_OFF = (
    "this server is shutting down and handed the generation over to another replica: send the "
    "request again with the same X-Request-Id (and Last-Event-ID) to read the rest"
)


class TokenRecorder(Protocol):
    """Where the token ids behind the text go, for a takeover (the shared log: `SharedLog`)."""

    def tokens(self, ids: Sequence[int]) -> None: ...

    def text(self, piece: str) -> None:
        """A text piece of a generation that does not stream (it has no events to carry it)."""
        ...


class GenerationOutput:
    def __init__(
        self,
        *,
        encoder: ChunkEncoder,
        events: EventLog,
        stream: bool,
        include_usage: bool,
        prompt_tokens: int = 0,
        choices: Choices | None = None,
    ) -> None:
        self.encoder = encoder
        self.choices = choices  # None: the plain fast path (one choice, no logprobs, no tools)
        self.events = events
        self.stream = stream
        self.include_usage = include_usage
        self.usage = Usage(prompt_tokens)
        self.text_parts: list[str] = []
        self.finish_reason: str | None = None
        self.error: BundleError | None = None
        self.done = False
        self.finished_at: float | None = None
        self.accepted = False  # the prompt was rendered and passed the checks; it may reach the engine
        # Set by a shared store with takeover on, for generations on the plain path (the only
        # ones a takeover continues): their token ids go to the log beside their text.
        self.recorder: TokenRecorder | None = None
        self.handed_off = False
        self.trace: GenerationTrace | None = None  # its spans, when its request is traced (OTLP on)
        self._text_changed = Notifier()  # waited on only by text and admission readers

    # --- writing (the producer task only) ----------------------------------------------------
    def accept(self, prompt_tokens: int) -> None:
        self.usage.prompt_tokens = prompt_tokens
        self.accepted = True
        self._text_changed.notify()

    def resume(self, prompt_tokens: int, text: str, completion_tokens: int) -> None:
        """A generation taken over from another replica: accepted there, `text` already sent."""
        self.accept(prompt_tokens)
        self.usage.completion_tokens = completion_tokens
        if text:
            self.text_parts.append(text)

    def hand_off(self) -> None:
        """End here without a word in the log: another replica continues it (its readers here
        see their stream end without [DONE], and resume)."""
        if self.done:
            return
        self.handed_off = True
        self.error = ShuttingDown(HANDED_OFF)
        self.done = True
        self.finished_at = time.monotonic()
        self.events.close()
        self._text_changed.notify()

    def reject(self, error: BundleError) -> None:
        """Refused before the engine (bad input found while rendering the prompt): readers
        waiting for admission get `error` as an HTTP error, and no stream is ever sent."""
        self.error = error
        self.done = True
        self.finished_at = time.monotonic()
        self.events.close()
        self._text_changed.notify()

    def emit(self, data: bytes) -> None:
        if self.stream:
            self.events.append(data)

    def open(self) -> None:
        """The stream's first events, before any token (chat: the assistant role per choice)."""
        if self.choices is not None:
            for opening in self.choices.openings(self.encoder):
                self.emit(opening)
            return
        first = self.encoder.opening()
        if first is not None:
            self.emit(first)

    def on_delta(self, delta: EngineDelta) -> None:
        self.usage.completion_tokens += delta.token_count
        if self.choices is not None:
            self._on_choice_delta(delta)
            return
        text, finish_reason = delta.text, delta.finish_reason
        if finish_reason is not None:
            self.finish_reason = finish_reason
        if self.recorder is not None:  # before the event below, which takes the ids along
            self.recorder.tokens(delta.token_ids)
            if text and not self.stream:
                self.recorder.text(text)
        if text:
            self.text_parts.append(text)
            self._text_changed.notify()
        if self.stream and (text or finish_reason is not None):
            self.emit(self.encoder.text(text, finish_reason))

    def _on_choice_delta(self, delta: EngineDelta) -> None:
        assert self.choices is not None
        choice = self.choices.apply(delta)
        if delta.index == 0:
            # Text readers (the Cog runner) follow the first choice's raw text: with tools that
            # is the model's own call format, which a plain-text client parses itself.
            if delta.text:
                self.text_parts.append(delta.text)
                self._text_changed.notify()
            self.finish_reason = self.choices.states[0].finish_reason
        if self.stream and choice is not None:
            self.emit(self.encoder.choice_chunk(choice))

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
        self.events.close()
        self._text_changed.notify()

    # --- reading ----------------------------------------------------------------------------
    async def admission(self) -> None:
        """Wait until the prompt is accepted (return) or refused (raise its 4xx error)."""
        while not self.accepted:
            if self.done:
                raise self.error or GenerationFailed("generation ended before admission")
            await self._text_changed.wait()

    async def follow_text(self) -> AsyncIterator[str]:
        """Yield the text from the start, each time everything new joined in one piece (a reader
        that falls behind gets its backlog at once); raise the generation's error if it failed."""
        cursor = 0
        while True:
            if cursor < len(self.text_parts):
                pieces = self.text_parts[cursor:]
                cursor += len(pieces)
                yield pieces[0] if len(pieces) == 1 else "".join(pieces)
                continue
            if self.done:
                if self.error is not None:
                    raise self.error
                return
            await self._text_changed.wait()

    async def wait(self) -> None:
        while not self.done:
            await self._text_changed.wait()

    def response(self) -> dict[str, Any]:
        """The non-streaming body; raises the generation's error if it failed."""
        if self.error is not None:
            raise self.error
        if self.choices is not None:
            return self.encoder.response_of(self.choices.whole(), self.usage)
        return self.encoder.response("".join(self.text_parts), self.finish_reason, self.usage)


async def produce(
    output: GenerationOutput,
    deltas: AsyncIterator[EngineDelta],
    metrics: Metrics,
    timeout_s: float,
    abort_reason: Callable[[], str],
    *,
    opening: bool = True,
) -> None:
    """The one task that drives a generation: it reads the engine's `deltas` into `output`.
    Cancelling it aborts the engine request; `abort_reason()` says why (the registry knows:
    disconnect, grace expiry, cancel...). `opening`: send the stream's first events (a takeover
    does not: they were sent by the replica it continues)."""
    metrics.engine_generations.inc()
    metrics.prompt_tokens.inc(output.usage.prompt_tokens)
    metrics.running_generations.inc()
    metrics.queued_requests.inc()
    waiting_for_first = True
    started = last = time.perf_counter()
    trace = output.trace
    if trace is not None:
        trace.engine_started()
    if opening:
        output.open()
    try:
        async with asyncio.timeout(timeout_s):
            async for delta in deltas:
                now = time.perf_counter()
                if waiting_for_first:
                    metrics.time_to_first_token.observe(now - started)
                    metrics.queued_requests.dec()
                    waiting_for_first = False
                    if trace is not None:
                        trace.first_token()
                elif delta.token_count:
                    metrics.inter_token_latency.observe((now - last) / delta.token_count)
                last = now
                metrics.generation_tokens.inc(delta.token_count)
                output.on_delta(delta)
        output.finish()
    except asyncio.CancelledError:
        # We cancel this task ourselves to abort (disconnect, grace expiry, cancel, shutdown);
        # vLLM's generator has already aborted the engine request on its way out.
        reason = abort_reason()
        metrics.aborted_requests.labels(reason).inc()
        if reason == HANDOFF:
            output.hand_off()
        else:
            output.finish(abort_error(reason))
    except TimeoutError:
        metrics.aborted_requests.labels("timeout").inc()
        output.finish(GenerationFailed(f"generation exceeded {timeout_s:g} s"))
    except ShuttingDown as exc:
        # The engine stopped with the server (a SIGTERM to the whole process group): what another
        # replica can continue is handed over at once instead of ended.
        if output.recorder is not None:
            output.hand_off()
        else:
            output.finish(exc)
    except BundleError as exc:
        output.finish(exc)
    except Exception as exc:  # never leave readers hanging on an unexpected failure
        log.exception("generation failed")
        output.finish(GenerationFailed(f"generation failed: {type(exc).__name__}"))
    finally:
        if waiting_for_first:
            metrics.queued_requests.dec()
        metrics.running_generations.dec()
        if trace is not None:
            trace.finished(output.usage.prompt_tokens, output.usage.completion_tokens, _outcome(output))


def _outcome(output: GenerationOutput) -> str:
    """How a generation ended, for its trace: its finish reason, or its error's kind."""
    if output.handed_off:
        return HANDOFF
    if output.error is not None:
        return type(output.error).__name__
    return output.finish_reason or "unknown"
