"""Request identity across replicas (BUNDLE_REDIS_URL): one generation per X-Request-Id on whichever
replica claims it first, followed from any other, cancelled from any, and taken over by another
replica when the one running it is lost.

`Service.open` asks `place` for requests that carry an id (this is the shared-store
`shared.replicas.identity.Identity`). The order of questions:
1. Does this replica hold the id (it owns the generation)? Its readers stay on the in-memory path.
2. Otherwise claim the id in the store (SET NX). Won: start the generation here, as `Service.open`
   always did, and mirror its events into the store (`own`). Lost: follow the owner's stream.
A resume never claims: a fresh generation under the old event ids would splice two texts.

Takeover (BUNDLE_TAKEOVER, on by default): when the owner of a running generation is gone (its
store connection closed: it died; or its heartbeat lapsed: the lease, shared/replicas/liveness.py) or
handed it over at shutdown, the replica
that a reader reaches swaps the claim to itself (TAKE_SCRIPT: of several that try, one wins) and
continues the generation from its log on its own engine (continuation.py), under
the next event ids. Every write of the log is fenced by the writer's claim, so a replica that
comes back from a pause to find its claim taken writes nothing more and stops.

Without takeover, a request for an id whose owner died gets 410 `producer_lost` until the claim
expires (`request_timeout_s + retention_s` after the claim).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from urllib.parse import urlsplit

import orjson

from shared.errors import BundleError, EventsGone, IdempotencyConflict, InvalidRequest, NotFound, ProducerLost
from shared.generation.output import HANDOFF
from shared.generation.registry import CancelOutcome, Entry, Registry, final_status
from shared.generation.replay import ReplayBuffer
from shared.generation.subscription import Subscription
from shared.obs.metrics import Metrics
from shared.replicas.continuation import Continuation
from shared.replicas.identity import Placement
from shared.replicas.liveness import HEARTBEAT_EVERY_S
from shared.replicas.owned_reader import OwnedReader
from shared.replicas.redis_log import SharedLog, StreamWriter
from shared.replicas.remote_subscription import RemoteSubscription
from shared.replicas.store import Claim, IdentityStore, StreamView
from shared.replicas.takeover import Logged, Recipe, read_log
from shared.settings import Settings
from shared.streaming import DONE_DATA

log = logging.getLogger(__name__)

CANCEL_POLL_S = 0.05  # how often a cancel sent to another replica looks for the generation's end
# How long leaving waits for the last events and ends to be written: a store that is down keeps
# them queued (retried), and shutdown must not wait on it for ever.
STORE_DRAIN_BOUND_S = 5.0


class Replicas:
    def __init__(
        self, settings: Settings, registry: Registry, metrics: Metrics, continuation: Continuation | None = None
    ) -> None:
        assert settings.redis_url is not None
        url = settings.redis_url.get_secret_value()
        self.replica_id = uuid.uuid4().hex[:16]
        self._settings = settings
        self._registry = registry
        self._metrics = metrics
        self._claim_ttl_s = settings.request_timeout_s + settings.retention_s
        self.takeover = settings.takeover
        self.store = IdentityStore(url, self.replica_id, metrics)
        self.writer = StreamWriter(
            self.store,
            settings.max_events_per_request,
            settings.retention_s,
            self._claim_ttl_s,
            # With takeover, readers here get an event only once the store has it: a write
            # window would delay every token by that much, so none (one loop turn) is used.
            window_s=0.0 if self.takeover else settings.redis_write_window_ms / 1000,
        )
        self.continuation = continuation  # how this replica's engine goes on with one taken over
        self._busy: dict[str, asyncio.Future[None]] = {}  # ids being claimed or taken over here
        self._claims: dict[str, Claim] = {}  # claims won, for the generation about to start here
        self._tasks: set[asyncio.Task[object]] = set()
        registry.followers_elsewhere = self._followers_elsewhere
        self.store.start(on_cancel=self._cancel_here)
        takeover = "on" if self.takeover else "off (BUNDLE_TAKEOVER=false)"
        log.info(
            "request identity: shared through %s (this replica: %s); takeover %s",
            _where(url),
            self.replica_id,
            takeover,
        )

    # --- open -----------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def place(
        self, request_id: str, fingerprint: str, stream: bool, last_event_id: int | None, *, numbered: bool
    ) -> AsyncIterator[Placement]:
        """Here when this replica holds the id or wins its claim (released again if the door
        refuses the request in the block); else a reader of the generation elsewhere."""
        after = last_event_id or 0
        async with self._exclusive(request_id):
            if self._registry.find(request_id, fingerprint) is not None:
                yield Placement(here=lambda local: self._owned(request_id, fingerprint, local, after))
                return
            mine = Claim(fingerprint, self.replica_id, stream, numbered=numbered)
            elsewhere = await self._claim_or_follow(request_id, mine, last_event_id)
            if elsewhere is not None:
                yield Placement(elsewhere)
                return
            async with self._claimed(request_id, mine):
                yield Placement(here=lambda local: self._owned(request_id, fingerprint, local, 0))

    @contextlib.asynccontextmanager
    async def _exclusive(self, request_id: str) -> AsyncIterator[None]:
        """One claim or takeover of an id at a time on this replica (the others wait for it)."""
        while (pending := self._busy.get(request_id)) is not None:
            await asyncio.wait({pending})
        done = asyncio.get_running_loop().create_future()
        self._busy[request_id] = done
        try:
            yield
        finally:
            del self._busy[request_id]
            done.set_result(None)

    async def _claim_or_follow(
        self, request_id: str, mine: Claim, last_event_id: int | None
    ) -> Subscription | None:
        """None: the claim is this replica's now (a new generation starts here)."""
        if last_event_id is None:
            claim = await self.store.claim(request_id, mine, self._claim_ttl_s)
            if claim is None:
                return None
        else:
            claim = await self.store.get(request_id)
            if claim is None:
                raise EventsGone(
                    f"no stream with X-Request-Id {request_id!r} is held any more; "
                    "start a new request with a new id"
                )
        if claim.fingerprint != mine.fingerprint:
            raise IdempotencyConflict(
                f"X-Request-Id {request_id!r} was already used with a different request body",
                param="X-Request-Id",
            )
        after = last_event_id or 0
        view = await self.store.view(request_id, claim.owner)
        if claim.running and not view.owner_alive and await self._came_back(claim.owner):
            view = await self.store.view(request_id, claim.owner)
        if claim.running and not view.owner_alive:
            taken = await self._take_over(request_id, time.monotonic())
            if isinstance(taken, Entry):
                return self._read_here(taken, after)
            if taken is None:
                raise ProducerLost(f"the replica that ran X-Request-Id {request_id!r} stopped; use a new id")
            claim = taken
            view = await self.store.view(request_id, claim.owner)
        if claim.stream:
            _check_resumable(view, after, finished=not claim.running)
        self._metrics.replayed_requests.inc()
        rescue = self._rescue if self.takeover else None
        return RemoteSubscription(self.store, request_id, claim, after, self._metrics, rescue)

    @contextlib.asynccontextmanager
    async def _claimed(self, request_id: str, mine: Claim) -> AsyncIterator[None]:
        """While the door starts the generation: the claim `mirror` fences the log with. Refused
        after the claim (bad input, 429): the id is freed, or nobody could use it."""
        self._claims[request_id] = mine
        try:
            yield
        except BaseException as refused:
            with contextlib.suppress(BundleError):
                await self.store.release(request_id, refused if isinstance(refused, BundleError) else None)
            raise
        finally:
            self._claims.pop(request_id, None)

    def _owned(self, request_id: str, fingerprint: str, local: Subscription, after: int) -> Subscription:
        """A reader of a generation this replica runs, that goes on from the shared log should
        another replica take the generation over (`OwnedReader`)."""
        entry = self._registry.find(request_id, fingerprint)
        if not self.takeover or entry is None or not isinstance(entry.output.events, SharedLog):
            return local
        return OwnedReader(local, entry.output.events, after, lambda sent: self._from_log(request_id, sent))

    async def _from_log(self, request_id: str, after: int) -> Subscription:
        claim = await self.store.get(request_id)
        if claim is None:
            raise EventsGone(f"events after {after} of this request are no longer held")
        return RemoteSubscription(self.store, request_id, claim, after, self._metrics, self._rescue)

    async def _came_back(self, owner: str) -> bool:
        """Whether `owner`'s heartbeat is back within two beats. Seen in CI: a follower found
        a live owner's key missing for a moment, and "producer lost" cannot be taken back (the
        client must start again with a new id), so a lapsed lease is believed only after a
        second look. A closed connection needs none: the process that held it is gone."""
        now = await self.store.liveness(owner)
        if now.alive or now.cause != "lease":
            return now.alive
        deadline = time.monotonic() + 2 * HEARTBEAT_EVERY_S
        while time.monotonic() < deadline:
            await asyncio.sleep(HEARTBEAT_EVERY_S / 4)
            if await self.store.alive(owner):
                log.warning("replica %s's heartbeat was missing for a moment; following it", owner)
                return True
        return False

    def _read_here(self, entry: Entry, after: int) -> Subscription:
        """A reader of a generation this replica just took over."""
        try:
            if entry.output.stream:
                entry.output.events.check_resumable(after)
        except BundleError:
            self._registry.unattended(entry)
            raise
        self._metrics.replayed_requests.inc()
        return self._registry.subscribe(entry, after)

    # --- takeover -------------------------------------------------------------------------------
    async def _take_over(self, request_id: str, lost_at: float) -> Entry | Claim | None:
        """Claim a generation whose owner is gone and continue it here. Returns the generation
        (taken here), the claim in force (another replica's, or an ended one), or None (no
        takeover: it is off, or the claim is gone)."""
        if not self.takeover or self.continuation is None:
            return None
        held = await self.store.held(request_id)
        if held is None or not held.claim.running:
            return None if held is None else held.claim
        if held.claim.owner == self.replica_id:
            return held.claim  # taken over already, by this replica
        owner = await self.store.liveness(held.claim.owner)
        if owner.alive:
            return held.claim  # taken over already by another, or its owner is back
        new = replace(held.claim, owner=self.replica_id, epoch=held.claim.epoch + 1)
        if not await self.store.take(request_id, held, new, self._claim_ttl_s, owner.beat):
            self._metrics.takeovers.labels("lost_race").inc()
            return await self.store.get(request_id)
        self._metrics.takeover_causes.labels(owner.cause or "lease").inc()
        entries, recipe = await self.store.log(request_id)
        logged = read_log(entries, recipe)
        if logged.end is not None:  # only the end was missing: write it, nothing to run
            self._metrics.takeovers.labels("finished").inc()
            ended = replace(new, state=logged.end)
            writer = self._fence(request_id, new)
            if not logged.closed:  # its error event went out, its [DONE] did not
                writer.append(request_id, logged.last + 1, DONE_DATA)
            writer.finish(request_id, ended, None)
            return ended
        return await self._continue(request_id, new, logged, lost_at)

    async def _continue(self, request_id: str, claim: Claim, logged: Logged, lost_at: float) -> Entry:
        """Run the rest here, under `claim` (this replica's now). Raises Overloaded (429) at the
        in-flight cap."""
        assert self.continuation is not None
        self._claims[request_id] = claim
        try:
            continued = await self.continuation.prepare(request_id, claim, logged, lost_at)
            self.mirror(continued.entry, kept=None if continued.refusal else continued.kept)
            self._registry.start(continued.entry, continued.producer)
            self.own(continued.entry)
            self.continuation.started(continued)
            return continued.entry
        except BaseException:
            # Not started here (429, or a failure): hand the claim on, so another replica can.
            self._fence(request_id, claim).finish(request_id, replace(claim, owner=""), None, running=True)
            raise
        finally:
            self._claims.pop(request_id, None)

    def _fence(self, request_id: str, claim: Claim) -> StreamWriter:
        """The writer, its writes of `request_id` fenced by `claim` (for ends written here)."""
        self.writer.guard(request_id, _Fence(claim.encode()))
        return self.writer

    async def _rescue(self, request_id: str) -> Claim | None:
        """A reader here found the owner it followed gone: take the generation over (or learn
        who did). Its continuation here has no reader of its own: the grace window starts."""
        async with self._exclusive(request_id):
            taken = await self._take_over(request_id, time.monotonic())
        if not isinstance(taken, Entry):
            return taken
        self._registry.unattended(taken)
        return await self.store.get(request_id)

    async def orphans(self, request_ids: list[str]) -> list[str]:
        """Those ids whose generation runs with its owner gone (for background work: nobody
        comes back for it, so someone must take it over)."""
        return await self.store.orphans(request_ids) if self.takeover else []

    async def hand_off(self) -> None:
        """Shutdown: stop every generation here that another replica can continue, write its
        last events and hand its claim over (owner ""); its readers here resume elsewhere."""
        if not self.takeover:
            return
        leaving = [entry for entry in self._registry.running_with_id() if entry.output.recorder is not None]
        for entry in leaving:
            self._registry.abort(entry, HANDOFF)
        await asyncio.gather(*(entry.task for entry in leaving if entry.task), return_exceptions=True)
        await self.writer.drain(timeout_s=STORE_DRAIN_BOUND_S)
        if leaving:
            log.info("handed %d generations over to other replicas", len(leaving))

    # --- the owner's side -------------------------------------------------------------------------
    def mirror(self, entry: Entry, kept: int | None = None) -> None:
        """Put the shared log behind a generation this replica is about to start (its claim is
        in `_claims`), fenced by that claim. Called before its task exists: the task may run its
        first steps at once (eager start) and emit. `kept`: a takeover's count of logged ids."""
        request_id = entry.request_id
        assert request_id is not None
        assert isinstance(entry.output.events, ReplayBuffer)
        claim = self._claims[request_id]
        shared = SharedLog(
            entry.output.events,
            self.writer,
            request_id,
            claim=claim,
            write_ahead=self.takeover,
            on_lost=lambda: self._lost(entry),
            kept=kept,
        )
        entry.output.events = shared
        if kept is not None and self.takeover:  # a continuation: its ids are logged from the start
            entry.output.recorder = shared

    def record(self, entry: Entry, recipe: Callable[[], Recipe]) -> None:
        """Log what a takeover needs; a generation it can continue also logs its token ids."""
        assert entry.request_id is not None and isinstance(entry.output.events, SharedLog)
        if not self.takeover:
            return
        made = recipe()
        self.writer.record(entry.request_id, made.encode())
        if made.refusal is None:
            entry.output.recorder = entry.output.events

    def own(self, entry: Entry) -> None:
        """Write the final state to the store when the generation (mirrored) ends."""
        request_id = entry.request_id
        assert request_id is not None and entry.task is not None
        output = entry.output
        shared = output.events
        assert isinstance(shared, SharedLog)  # mirrored before the task started
        claim = shared.holder
        assert claim is not None

        def finished(_: asyncio.Task[None]) -> None:
            if shared.taken_over:
                return  # the claim is another replica's: nothing more of ours is written
            if output.handed_off:
                self._metrics.handoffs.inc()
                self.writer.finish(request_id, replace(claim, owner=""), None, running=True)
                return
            body = None
            if not output.stream or not output.accepted:
                # A whole answer, or the 4xx of a request refused while rendering its prompt
                # (a refused stream has no events): readers elsewhere answer with the same.
                try:
                    body = orjson.dumps({"status": 200, "body": output.response()})
                except BundleError as error:
                    body = orjson.dumps({"status": error.status_code, "body": error.to_openai()})
            ended = replace(claim, state=final_status(entry))
            self.writer.finish(request_id, ended, body, shared.next_sequence)

        entry.task.add_done_callback(finished)

    def _lost(self, entry: Entry) -> None:
        log.warning("generation %s was taken over by another replica; stopped here", entry.request_id)
        self._metrics.claims_lost.inc()
        self._registry.abort(entry, "taken_over")

    async def _followers_elsewhere(self, entry: Entry) -> float:
        """The registry's grace window asks: how much longer do readers on other replicas hold
        this generation? Their presence key lapses when they stop; then the window runs again."""
        assert entry.request_id is not None
        try:
            remaining = await self.store.followers_left_s(entry.request_id)
        except BundleError:
            return 0.0  # nobody elsewhere can read while the store is down
        return remaining + self._settings.disconnect_grace_s if remaining else 0.0

    def _cancel_here(self, request_id: str) -> None:
        async def cancel() -> None:
            with contextlib.suppress(NotFound):
                await self._registry.cancel(request_id, wait_s=0)

        task = asyncio.get_running_loop().create_task(cancel())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- cancel from anywhere ---------------------------------------------------------------------
    async def cancel(self, request_id: str, wait_s: float) -> CancelOutcome:
        """Cancel an id this replica does not hold: ask its owner, wait (bounded) for the end."""
        claim = await self.store.get(request_id)
        if claim is None:
            raise NotFound(f"no request with id {request_id!r} is held", param="request_id")
        if not claim.running:
            return CancelOutcome(request_id, claim.state)
        await self.store.publish_cancel(claim.owner, request_id)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            await asyncio.sleep(CANCEL_POLL_S)
            now = await self.store.get(request_id)
            if now is None or not now.running:
                return CancelOutcome(request_id, now.state if now is not None else "cancelled")
        return CancelOutcome(request_id, "cancelling")

    async def aclose(self) -> None:
        """After the registry's shutdown: send the last events and ends, then leave."""
        await self.writer.drain(timeout_s=STORE_DRAIN_BOUND_S)
        with contextlib.suppress(TimeoutError):  # cancels relayed from elsewhere: bounded, as the drain
            async with asyncio.timeout(STORE_DRAIN_BOUND_S):
                await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.store.aclose()


class _Fence:
    """A writer's guard for an end written without a generation here (`_take_over`)."""

    def __init__(self, claim: bytes) -> None:
        self.claim = claim

    def written(self, upto: int) -> None:
        pass

    def lost(self) -> None:
        pass


def _check_resumable(view: StreamView, after: int, *, finished: bool) -> None:
    """Refuse before any byte is sent if the stored events cannot continue after `after`."""
    if view.first is not None and after + 1 < view.first:
        raise EventsGone(
            f"events after {after} are no longer held (oldest held: {view.first}); "
            "restart the request with a new X-Request-Id"
        )
    if finished and view.last is not None and after >= view.last:
        raise InvalidRequest(f"Last-Event-ID {after} is beyond the end of this stream")


def _where(url: str) -> str:
    """The store's address for the log, without credentials."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}:{parts.port or 6379}{parts.path}"
