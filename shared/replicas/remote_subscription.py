"""A reader of a generation that another replica runs: `RemoteSubscription` follows the owner's
stream in the shared store and hands it out as this replica's own readers hand out theirs.

It re-frames the stored data as the claim says (`sse_event` when the creator's stream is
numbered, `sse_data` otherwise), so its bytes equal the owner's. The owner's replica reads through
it too, once it has let the result go from memory. When the owner is lost, a takeover (`Rescue`)
may name the replica that goes on.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson

from shared.errors import BundleError, EventsGone, ProducerLost, StoredError
from shared.generation.replay import EventsPerWrite, WriteNow
from shared.obs.metrics import Metrics
from shared.replicas.liveness import HEARTBEAT_TTL_S
from shared.replicas.store import BODY, DATA, RUNNING, Claim, IdentityStore
from shared.streaming import DONE_DATA, Usage, error_frames, sse_data, sse_event

# Asked when a followed generation's owner is gone: the claim in force after this replica tried
# to take the generation over (its own, another's, or an ended one); None: it cannot go on.
Rescue = Callable[[str], Awaitable[Claim | None]]
# An error event inside a stream carries no HTTP status (the 200 was sent long before): a text
# reader raises it as a server-side failure, its OpenAI type and code kept.
GENERATION_ERROR_STATUS = 500
# While events flow, a follower checks its owner every CHECK_EVERY_S (after an idle read, at once):
# shared/replicas/store.py says how soon a dead owner is seen.
CHECK_EVERY_S = 0.25


class RemoteSubscription:
    """A reader of a generation owned elsewhere: a `shared.generation.subscription.Subscription`, as this
    replica's own readers are."""

    def __init__(
        self,
        store: IdentityStore,
        request_id: str,
        claim: Claim,
        after: int,
        metrics: Metrics,
        rescue: Rescue | None = None,
    ) -> None:
        self._store = store
        self._request_id = request_id
        self._rescue = rescue  # None: a lost owner ends the reading (producer_lost)
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
        """Batches of entries after `after`; raises ProducerLost or EventsGone rather than hang.
        When the owner is gone, `rescue` (a takeover) may name the replica that goes on."""
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
            handed_on = step.claim is not None and step.claim.running and step.claim.owner != self._owner
            if step.owner_alive is False or handed_on:  # gone, handed over, or taken over
                self._owner = await self._successor()
                continue
            if check and step.state is None:
                raise await self._claim_gone(after)

    async def _claim_gone(self, after: int) -> BundleError:
        """Why no more events can come: the claim was released after a refusal (the owner's
        answer, which this reader gives too), or it expired (past the longest generation plus
        the retention: its end was never stored)."""
        refused = await self._store.refusal(self._request_id)
        return refused or EventsGone(f"events after {after} of this request are no longer held")

    async def _successor(self) -> str:
        """The owner to follow now that the last one is gone: whoever holds the claim after a
        takeover was tried (an ended claim: its events say the rest)."""
        claim = await self._rescue(self._request_id) if self._rescue is not None else None
        if claim is None:
            raise ProducerLost(
                f"the replica running X-Request-Id {self._request_id!r} stopped (its store "
                f"connection closed, or no heartbeat for {HEARTBEAT_TTL_S:g} s); start again with a "
                "new X-Request-Id"
            )
        return claim.owner

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
