"""Request identity across replicas (BUNDLE_REDIS_URL): one generation per X-Request-Id on whichever
replica claims it first, followed from any other, cancelled from any.

`Service.open` calls `open` here for requests that carry an id (this is the shared-store
`shared.identity.interface.Identity`). The order of questions:
1. Does this replica hold the id (it owns the generation)? Its readers stay on the in-memory path.
2. Otherwise claim the id in the store (SET NX). Won: start the generation here, as `Service.open`
   always did, and mirror its events into the store (`own`). Lost: follow the owner's stream.
A resume never claims: a fresh generation under the old event ids would splice two texts.

A new request for an id whose owner died gets 410 `producer_lost` until the claim expires
(`request_timeout_s + retention_s` after the claim): the old stream cannot be continued, and
running the body again would break "one generation per id".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import replace
from urllib.parse import urlsplit

import orjson

from shared.errors import BundleError, EventsGone, IdempotencyConflict, InvalidRequest, NotFound, ProducerLost
from shared.identity.interface import OpenHere, Subscription
from shared.identity.redis_log import RemoteSubscription, SharedLog, StreamWriter
from shared.identity.registry import CancelOutcome, Entry, Registry, final_status
from shared.identity.replay import ReplayBuffer
from shared.identity.store import Claim, IdentityStore, StreamView
from shared.obs.metrics import Metrics
from shared.settings import Settings

log = logging.getLogger(__name__)

CANCEL_POLL_S = 0.05  # how often a cancel sent to another replica looks for the generation's end
# How long leaving waits for the last events and ends to be written: a store that is down keeps
# them queued (retried), and shutdown must not wait on it for ever.
STORE_DRAIN_BOUND_S = 5.0


class Replicas:
    def __init__(self, settings: Settings, registry: Registry, metrics: Metrics) -> None:
        assert settings.redis_url is not None
        url = settings.redis_url.get_secret_value()
        self.replica_id = uuid.uuid4().hex[:16]
        self._settings = settings
        self._registry = registry
        self._metrics = metrics
        self._claim_ttl_s = settings.request_timeout_s + settings.retention_s
        self.store = IdentityStore(url, self.replica_id, metrics)
        self.writer = StreamWriter(
            self.store,
            settings.max_events_per_request,
            settings.retention_s,
            self._claim_ttl_s,
            window_s=settings.redis_write_window_ms / 1000,
        )
        self._claiming: dict[str, asyncio.Future[None]] = {}
        self._tasks: set[asyncio.Task[object]] = set()
        registry.followers_elsewhere = self._followers_elsewhere
        self.store.start(on_cancel=self._cancel_here)
        log.info("request identity: shared through %s (this replica: %s)", _where(url), self.replica_id)

    # --- open -----------------------------------------------------------------------------------
    async def open(
        self,
        request_id: str,
        fingerprint: str,
        stream: bool,
        last_event_id: int | None,
        here: OpenHere,
        *,
        numbered: bool,
    ) -> Subscription:
        """`here()` opens on this replica (attach, resume or start, as `Service.open`)."""
        while (pending := self._claiming.get(request_id)) is not None:
            await asyncio.wait({pending})  # another request here is claiming this id: wait for it
        if self._registry.find(request_id, fingerprint) is not None:
            return here()
        done = asyncio.get_running_loop().create_future()
        self._claiming[request_id] = done
        try:
            mine = Claim(fingerprint, self.replica_id, stream, numbered=numbered)
            return await self._claim_or_follow(request_id, mine, last_event_id, here)
        finally:
            del self._claiming[request_id]
            done.set_result(None)

    async def _claim_or_follow(
        self, request_id: str, mine: Claim, last_event_id: int | None, here: OpenHere
    ) -> Subscription:
        if last_event_id is None:
            claim = await self.store.claim(request_id, mine, self._claim_ttl_s)
            if claim is None:
                return await self._start(request_id, here)
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
        view = await self.store.view(request_id, claim.owner)
        if claim.running and not view.owner_alive:
            raise ProducerLost(f"the replica that ran X-Request-Id {request_id!r} stopped; use a new id")
        after = last_event_id or 0
        if claim.stream:
            _check_resumable(view, after, finished=not claim.running)
        self._metrics.replayed_requests.inc()
        return RemoteSubscription(self.store, request_id, claim, after, self._metrics)

    async def _start(self, request_id: str, here: OpenHere) -> Subscription:
        try:
            return here()  # validates, admits and starts; Service._start calls `own`
        except BaseException:
            # Refused after the claim (bad input, 429): free the id, or nobody could use it.
            with contextlib.suppress(BundleError):
                await self.store.release(request_id)
            raise

    # --- the owner's side -------------------------------------------------------------------------
    def mirror(self, entry: Entry) -> None:
        """Put the shared log behind a generation this replica is about to start. Called before
        its task exists: the task may run its first steps at once (eager start) and emit."""
        request_id = entry.request_id
        assert request_id is not None
        assert isinstance(entry.output.events, ReplayBuffer)
        entry.output.events = SharedLog(entry.output.events, self.writer, request_id)

    def own(self, entry: Entry) -> None:
        """Write the final state to the store when the generation (mirrored) ends."""
        request_id = entry.request_id
        assert request_id is not None and entry.fingerprint is not None and entry.task is not None
        output = entry.output
        # Followers re-frame the stored data (RemoteSubscription) as the claim says: with ids
        # exactly when the creator's own buffer numbers its events, so every reader's bytes match.
        assert isinstance(output.events, SharedLog)  # mirrored before the task started
        claim = Claim(entry.fingerprint, self.replica_id, output.stream, numbered=output.events.numbered)

        def finished(_: asyncio.Task[None]) -> None:
            body = None
            if not output.stream or not output.accepted:
                # A whole answer, or the 4xx of a request refused while rendering its prompt
                # (a refused stream has no events): readers elsewhere answer with the same.
                try:
                    body = orjson.dumps({"status": 200, "body": output.response()})
                except BundleError as error:
                    body = orjson.dumps({"status": error.status_code, "body": error.to_openai()})
            ended = replace(claim, state=final_status(entry))
            self.writer.finish(request_id, ended, body)

        entry.task.add_done_callback(finished)

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
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.store.aclose()


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
