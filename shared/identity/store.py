"""The shared identity store: request claims, replica heartbeats, the cancel channel and the event
streams of every replica, in one Redis (or Valkey) database.

Keys, one deployment per database (a second deployment uses another: redis://host/1):
  bundle:claim:{id}       JSON {fp, owner, stream, state, numbered}; SET NX makes the first replica the owner
  bundle:events:{id}      a Stream; entry id "<seq>-0", field d = one SSE event's data, b = a whole
                          non-streaming answer or the 4xx of a refused request ({status, body})
  bundle:follow:{id}      exists while a follower on some replica reads (refreshed, short expiry)
  bundle:replica:{rid}    a replica's heartbeat (refreshed, short expiry)
  bundle:cancel:{rid}     pub/sub channel: ids the replica `rid` must abort

Every round trip goes through `_trip`, which times it, counts its commands for /metrics and turns
a connection failure into `StoreUnavailable` (HTTP 503). redis-py reconnects on the next command,
so the bundle recovers without a restart when the server comes back.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson
from redis.exceptions import NoScriptError, RedisError

from shared.errors import StoreUnavailable
from shared.obs.metrics import Metrics
from shared.redis_client import redis_client

log = logging.getLogger(__name__)

PREFIX = "bundle:"
RUNNING = "running"
# Liveness. A replica refreshes its heartbeat every HEARTBEAT_EVERY_S; it lapses HEARTBEAT_TTL_S
# after the last refresh. A follower blocks at most READ_BLOCK_MS per read, and every read after
# an idle one also checks the owner's heartbeat (while events flow, every CHECK_EVERY_S). So after
# the owner dies: its heartbeat lapses within HEARTBEAT_TTL_S, the read in flight ends within one
# block, the next one checks and ends within another: PRODUCER_LOST_BOUND_S.
HEARTBEAT_EVERY_S = 1.0
HEARTBEAT_TTL_S = 3.0
READ_BLOCK_MS = 1000  # below the client's socket timeout (shared/redis_client.py)
CHECK_EVERY_S = 1.0
PRODUCER_LOST_BOUND_S = HEARTBEAT_TTL_S + 2 * READ_BLOCK_MS / 1000  # 5 s
FOLLOW_TTL_S = 3.0  # a follower that stopped refreshing no longer holds the generation open
RECONNECT_S = 0.5  # pause between attempts of the background loops while the store is down


@dataclass(frozen=True)
class Claim:
    fingerprint: str  # of the request body: another body under this id is a conflict
    owner: str  # the replica that runs the generation
    stream: bool
    state: str = RUNNING  # then the registry's final status: completed, failed, cancelled
    # Whether the creator's events carry `id:` lines; followers elsewhere frame theirs the same.
    # True when absent: claims written before this field existed were always numbered.
    numbered: bool = True

    @property
    def running(self) -> bool:
        return self.state == RUNNING

    def encode(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def decode(cls, raw: object) -> Claim:
        assert isinstance(raw, bytes | str), raw  # what GET and SET ... GET return for a string key
        return cls(**orjson.loads(raw))


@dataclass(frozen=True)
class StreamView:
    """What a follower needs to know before its first byte: which events are held, is the owner up."""

    first: int | None  # sequence number of the oldest event held; None: none written yet
    last: int | None
    owner_alive: bool


@dataclass(frozen=True)
class ReadStep:
    entries: list[tuple[int, dict[bytes, bytes]]]  # (sequence, fields), in order
    owner_alive: bool | None  # None: not checked on this step
    state: str | None  # the claim's state when checked; None: not checked or gone


def claim_key(request_id: str) -> str:
    return f"{PREFIX}claim:{request_id}"


def events_key(request_id: str) -> str:
    return f"{PREFIX}events:{request_id}"


def follow_key(request_id: str) -> str:
    return f"{PREFIX}follow:{request_id}"


def replica_key(replica_id: str) -> str:
    return f"{PREFIX}replica:{replica_id}"


def cancel_channel(replica_id: str) -> str:
    return f"{PREFIX}cancel:{replica_id}"


# The owner's writes of one flush, as one script call. KEYS: the stream of each event, then
# (stream, claim) per finished generation. ARGV: max events per stream, the running and the
# retention TTLs (ms), the number of events, then per event its sequence, data and whether
# its stream is new (1: set the running TTL), then per end its answer ("" for a stream) and
# final claim. In order, so a generation's end is written after its events.
DATA = b"d"  # field of one streamed event's data
BODY = b"b"  # field of a non-streaming answer: {"status", "body"}
APPEND_SCRIPT = f"""
local max_events, running_ttl, retention = ARGV[1], ARGV[2], ARGV[3]
local events = tonumber(ARGV[4])
local a = 5
for i = 1, events do
  redis.call('XADD', KEYS[i], 'MAXLEN', '~', max_events, ARGV[a] .. '-0', '{DATA.decode()}', ARGV[a + 1])
  if ARGV[a + 2] == '1' then redis.call('PEXPIRE', KEYS[i], running_ttl) end
  a = a + 3
end
for k = events + 1, #KEYS, 2 do
  if ARGV[a] ~= '' then redis.call('XADD', KEYS[k], '1-0', '{BODY.decode()}', ARGV[a]) end
  redis.call('PEXPIRE', KEYS[k], retention)
  redis.call('SET', KEYS[k + 1], ARGV[a + 1], 'PX', retention)
  a = a + 2
end
return events
"""


@dataclass
class AppendBatch:
    """One flush's keys and arguments for APPEND_SCRIPT, and the commands it stands for."""

    keys: list[str] = field(default_factory=list)
    args: list[bytes | str | int] = field(default_factory=list)
    commands: int = 0


class IdentityStore:
    def __init__(self, url: str, replica_id: str, metrics: Metrics) -> None:
        self.replica_id = replica_id
        self.metrics = metrics
        self.client = redis_client(url)  # timeouts and retry: shared/redis_client.py
        self._tasks: list[asyncio.Task[None]] = []
        self._append_sha = hashlib.sha1(APPEND_SCRIPT.encode()).hexdigest()  # what the server names it

    # --- accounting ---------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _trip(self, op: str, commands: int = 1) -> AsyncIterator[None]:
        self.metrics.store_round_trips.labels(op).inc()
        self.metrics.store_commands.labels(op).inc(commands)
        started = time.perf_counter()
        try:
            yield
        except (RedisError, OSError) as exc:
            self.metrics.store_errors.labels(op).inc()
            raise StoreUnavailable(
                f"the shared request-identity store (Redis) is unavailable ({type(exc).__name__}); "
                "requests with X-Request-Id cannot be served now, requests without one can"
            ) from exc
        finally:
            self.metrics.store_latency.labels(op).observe(time.perf_counter() - started)

    # --- claims -------------------------------------------------------------------------------
    async def claim(self, request_id: str, claim: Claim, ttl_s: float) -> Claim | None:
        """Make `claim` the id's claim unless one exists: None when this call won, else the
        existing claim (one atomic SET NX GET, so two replicas can never both win)."""
        async with self._trip("claim"):
            old = await self.client.set(claim_key(request_id), claim.encode(), nx=True, get=True, px=_ms(ttl_s))
        return None if old is None else Claim.decode(old)

    async def get(self, request_id: str) -> Claim | None:
        async with self._trip("get"):
            raw = await self.client.get(claim_key(request_id))
        return None if raw is None else Claim.decode(raw)

    async def release(self, request_id: str) -> None:
        """Give up a claim whose generation never started (it was refused after the claim)."""
        async with self._trip("release"):
            await self.client.delete(claim_key(request_id))

    # --- followers ----------------------------------------------------------------------------
    async def view(self, request_id: str, owner: str) -> StreamView:
        key = events_key(request_id)
        async with self._trip("view", 3), self.client.pipeline(transaction=False) as pipe:
            pipe.xrange(key, "-", "+", count=1)
            pipe.xrevrange(key, "+", "-", count=1)
            pipe.exists(replica_key(owner))
            first, last, alive = await pipe.execute()
        return StreamView(_first_sequence(first), _first_sequence(last), bool(alive))

    async def read(self, request_id: str, after: int, owner: str | None) -> ReadStep:
        """Events after `after`, waiting up to READ_BLOCK_MS for some. With `owner`, the same
        round trip also refreshes this follower's presence and checks the owner and the claim
        (before the read, so 'alive and nothing came' means: nothing yet)."""
        key = events_key(request_id)
        commands = 4 if owner is not None else 1
        async with self._trip("read", commands), self.client.pipeline(transaction=False) as pipe:
            if owner is not None:
                pipe.set(follow_key(request_id), b"1", px=_ms(FOLLOW_TTL_S))
                pipe.exists(replica_key(owner))
                pipe.get(claim_key(request_id))
            pipe.xread({key: f"{after}-0"}, count=4096, block=READ_BLOCK_MS)
            results = await pipe.execute()
        entries = [(_sequence(entry_id), fields) for _, batch in results[-1] for entry_id, fields in batch]
        if owner is None:
            return ReadStep(entries, None, None)
        raw_claim = results[2]
        state = None if raw_claim is None else Claim.decode(raw_claim).state
        return ReadStep(entries, bool(results[1]), state)

    async def followers_left_s(self, request_id: str) -> float:
        """Seconds until the last follower elsewhere lapses if it stops reading; 0: none."""
        async with self._trip("grace"):
            remaining_ms = await self.client.pttl(follow_key(request_id))
        return max(remaining_ms, 0) / 1000

    # --- writes (the owner) ---------------------------------------------------------------------
    async def append(self, batch: AppendBatch) -> None:
        """One round trip, one command: every event and end of a flush, appended by a script.

        One XADD per event in a pipeline costs the API process ~23-28 us of CPU per event at 256
        streams (redis-py builds and parses each command in Python), the script ~7 us
        (`python -m bench.store_writes`, results/cpu/store-writes.txt); at 256 streams an
        event carries one token."""
        async with self._trip("write", batch.commands):
            try:
                await self.client.evalsha(self._append_sha, len(batch.keys), *batch.keys, *batch.args)
            except NoScriptError:  # a new or restarted server: load it once, then again by hash
                self._append_sha = await self.client.script_load(APPEND_SCRIPT)
                await self.client.evalsha(self._append_sha, len(batch.keys), *batch.keys, *batch.args)

    # --- cancel -------------------------------------------------------------------------------
    async def publish_cancel(self, owner: str, request_id: str) -> None:
        async with self._trip("cancel"):
            await self.client.publish(cancel_channel(owner), request_id.encode())

    # --- background: heartbeat and cancel listener -----------------------------------------------
    def start(self, on_cancel: Callable[[str], None]) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._heartbeat()), loop.create_task(self._listen(on_cancel))]

    async def _heartbeat(self) -> None:
        while True:
            with contextlib.suppress(StoreUnavailable):  # counted in /metrics; retried next beat
                async with self._trip("heartbeat"):
                    await self.client.set(replica_key(self.replica_id), b"1", px=_ms(HEARTBEAT_TTL_S))
            await asyncio.sleep(HEARTBEAT_EVERY_S)

    async def _listen(self, on_cancel: Callable[[str], None]) -> None:
        while True:
            try:
                async with self.client.pubsub() as pubsub:
                    await pubsub.subscribe(cancel_channel(self.replica_id))
                    async for message in pubsub.listen():
                        if message.get("type") == "message":
                            on_cancel(message["data"].decode())
            except (RedisError, OSError) as exc:
                self.metrics.store_errors.labels("listen").inc()
                log.debug("cancel channel lost (%s); subscribing again", exc)
            await asyncio.sleep(RECONNECT_S)

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        with contextlib.suppress(RedisError, OSError):
            await self.client.delete(replica_key(self.replica_id))  # followers learn at once
        await self.client.aclose()


def _ms(seconds: float) -> int:
    return max(int(seconds * 1000), 1)


def _sequence(entry_id: bytes) -> int:
    return int(entry_id.split(b"-", 1)[0])


def _first_sequence(entries: list[tuple[bytes, Any]]) -> int | None:
    return _sequence(entries[0][0]) if entries else None
