"""Replica liveness through the identity store: this replica's heartbeat on a connection of its
own, and the verdict on another replica's (its lease, then that connection).

A replica holds one connection of its own (the control connection) and writes that connection's
CLIENT ID into its heartbeat key every HEARTBEAT_EVERY_S. Another replica counts it dead when the
key is gone (the lease, HEARTBEAT_TTL_S: what no socket shows, a frozen or cut-off host) or when
that connection is no longer in the store's CLIENT LIST (a process that dies, is killed or runs
out of memory closes its sockets at once: followers see it within DEATH_SEEN_BOUND_S,
shared/replicas/store.py). A process that is alive but slow (a late event loop, a starved CPU, a
pause under SIGSTOP) keeps its socket open, so it is never taken for dead before its lease lapses.
Stores that refuse CLIENT ID or CLIENT LIST (some managed services) leave the lease alone: one
line at start says so.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from redis.exceptions import ResponseError

from shared.errors import StoreUnavailable
from shared.replicas.round_trips import RoundTrips, ms
from shared.replicas.store_keys import replica_key

if TYPE_CHECKING:
    from redis.asyncio import Redis

log = logging.getLogger(__name__)

# The lease: a heartbeat every HEARTBEAT_EVERY_S lapses HEARTBEAT_TTL_S after the last one; long,
# because it only stands in for what a socket cannot show (a frozen or partitioned host), and a
# live replica whose loop ran seconds late must not lose it.
HEARTBEAT_EVERY_S = 1.0
HEARTBEAT_TTL_S = 10.0
# Whether a replica's connection stands is asked at most this often per process.
CONNECTION_FRESH_S = 0.05
# A heartbeat's value: "c:<CLIENT ID of the control connection>", or LEASE_ONLY where the store
# refuses CLIENT ID / CLIENT LIST (then the key alone says the replica is alive).
CONNECTION_BEAT = b"c:"
LEASE_ONLY = b"lease"


@dataclass(frozen=True)
class Liveness:
    """Whether a replica runs, as the store can tell: `cause` says why not ("connection": its
    control connection is gone; "lease": its heartbeat lapsed; "handoff": it handed the claim
    over), and `beat` is the heartbeat seen (what a takeover must still find)."""

    alive: bool
    cause: str | None = None
    beat: bytes = b""


class Heartbeat:
    """This replica's lease, written every HEARTBEAT_EVERY_S on the control connection (one,
    never shared) and naming it by its CLIENT ID."""

    def __init__(self, control: Redis, replica_id: str, trips: RoundTrips) -> None:
        self.control = control
        self.replica_id = replica_id
        self._trips = trips
        # None until the first beat found out whether the store answers CLIENT ID / CLIENT LIST.
        self.watch_connections: bool | None = None

    @property
    def key(self) -> str:
        return replica_key(self.replica_id)

    async def run(self) -> None:
        while True:
            try:
                await self.beat()
            except StoreUnavailable:
                pass  # counted in /metrics; retried next beat
            except Exception:  # a dead heartbeat task would declare this live replica dead
                self._trips.metrics.store_errors.labels("heartbeat", "unexpected").inc()
                log.exception("heartbeat to the identity store failed unexpectedly; retrying")
            await asyncio.sleep(HEARTBEAT_EVERY_S)

    async def beat(self) -> None:
        """Write the lease, naming the control connection it stands on (its CLIENT ID)."""
        if self.watch_connections is None:
            self.watch_connections = await self._can_watch_connections()
        beat = LEASE_ONLY
        if self.watch_connections:
            async with self._trips.trip("heartbeat"):
                beat = CONNECTION_BEAT + str(await self.control.client_id()).encode()
        async with self._trips.trip("heartbeat"):
            await self.control.set(self.key, beat, px=ms(HEARTBEAT_TTL_S))

    async def _can_watch_connections(self) -> bool:
        """Whether the store answers CLIENT ID and CLIENT LIST ID (said once, in one line)."""
        try:
            async with self._trips.trip("heartbeat", 2):
                own = await self.control.client_id()
                listed = await self.control.client_list(client_id=[own])
        except StoreUnavailable as unavailable:
            if not isinstance(unavailable.__cause__, ResponseError):
                raise  # the store is down: ask again at the next beat
            listed = []
        if listed:
            log.info(
                "replica liveness: by connection (CLIENT LIST), the %g s lease as fallback", HEARTBEAT_TTL_S
            )
            return True
        log.warning(
            "replica liveness: the store refuses CLIENT ID / CLIENT LIST, so a replica's death is "
            "seen only when its %g s heartbeat lease lapses",
            HEARTBEAT_TTL_S,
        )
        return False


class LivenessJudge:
    """Whether another replica runs (module docstring): its heartbeat, then its connection."""

    def __init__(self, client: Redis, trips: RoundTrips) -> None:
        self._client = client
        self._trips = trips
        self._connected: dict[int, tuple[float, bool]] = {}  # CLIENT ID -> (when asked, listed)
        self._asking: dict[int, asyncio.Future[bool]] = {}

    async def liveness(self, replica_id: str) -> Liveness:
        if not replica_id:
            return Liveness(False, "handoff")
        async with self._trips.trip("alive"):
            beat = await self._client.get(replica_key(replica_id))
        return await self.verdict(beat)

    async def verdict(self, beat: bytes | str | None) -> Liveness:
        """A heartbeat's verdict: none is a lapsed lease; a connection's id must still be listed."""
        if beat is None:
            return Liveness(False, "lease")
        if isinstance(beat, str):  # a client that decodes answers (never the identity store's)
            beat = beat.encode()
        if not beat.startswith(CONNECTION_BEAT):
            return Liveness(True, beat=beat)  # LEASE_ONLY: the key alone says it
        if await self._listed(int(beat[len(CONNECTION_BEAT) :])):
            return Liveness(True, beat=beat)
        return Liveness(False, "connection", beat)

    async def _listed(self, client_id: int) -> bool:
        """Whether the store still has connection `client_id` (CLIENT LIST ID), asked at most every
        CONNECTION_FRESH_S by this process: concurrent askers share one question."""
        known = self._connected.get(client_id)
        if known is not None and time.monotonic() - known[0] <= CONNECTION_FRESH_S:
            return known[1]
        asking = self._asking.get(client_id)
        if asking is not None:
            return await asyncio.shield(asking)
        asking = self._asking[client_id] = asyncio.get_running_loop().create_future()
        try:
            async with self._trips.trip("connected"):
                listed = bool(await self._client.client_list(client_id=[client_id]))
        except BaseException as exc:
            asking.set_exception(exc)
            asking.exception()  # retrieved: waiters, if any, raise it themselves
            raise
        finally:
            del self._asking[client_id]
        if len(self._connected) > 4096:  # ids of connections long gone
            self._connected.clear()
        self._connected[client_id] = (time.monotonic(), listed)
        asking.set_result(listed)
        return listed
