"""The shared identity store: request claims, the event log of every generation and the cancel
channel, in one Redis (or Valkey) database, with the liveness of the replicas that write them.

`IdentityStore` is what the rest of the bundle asks. Its keys are named in
shared/replicas/store_keys.py; every round trip is counted, timed and bounded as
shared/replicas/round_trips.py says; a replica's heartbeat and the verdict on another's are in
shared/replicas/liveness.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson
from redis.exceptions import NoScriptError, RedisError

from shared.errors import BundleError, Overloaded, StoredError
from shared.obs.metrics import Metrics
from shared.redis_client import redis_client
from shared.replicas.liveness import CONNECTION_FRESH_S, HEARTBEAT_TTL_S, Heartbeat, Liveness, LivenessJudge
from shared.replicas.round_trips import RoundTrips, error_kind, ms
from shared.replicas.store_keys import (
    PREFIX,
    cancel_channel,
    claim_key,
    events_key,
    follow_key,
    recipe_key,
    refused_key,
    replica_key,
)

log = logging.getLogger(__name__)

RUNNING = "running"
# How soon a follower sees its owner gone (shared/replicas/liveness.py): it blocks at most
# READ_BLOCK_MS per read and checks the owner after every idle read (while events flow, every
# CHECK_EVERY_S of shared/replicas/remote_subscription.py); whether the owner's connection stands is
# asked at most every CONNECTION_FRESH_S per process. So a dead owner's connection is found gone
# within DEATH_SEEN_BOUND_S (the read in flight, then one more with a cached answer); a lapsed
# lease within PRODUCER_LOST_BOUND_S.
READ_BLOCK_MS = 200  # a follower's blocking read: it holds a connection of the read pool meanwhile
DEATH_SEEN_BOUND_S = 2 * READ_BLOCK_MS / 1000 + CONNECTION_FRESH_S  # 0.45 s
PRODUCER_LOST_BOUND_S = HEARTBEAT_TTL_S + 2 * READ_BLOCK_MS / 1000  # 10.4 s
# Long enough for every follower that was reading when a claim was released to read it.
REFUSAL_TTL_S = 10
FOLLOW_TTL_S = 3.0  # a follower that stopped refreshing no longer holds the generation open
CLOSE_BOUND_S = 2.0  # for each of the last words at exit: the heartbeat's delete, each client's close
# Connections for followers' blocking reads, apart from the pool every other command uses: a
# read holds its connection for up to READ_BLOCK_MS, and must never make a claim wait behind it.
READ_CONNECTIONS = 512
RECONNECT_S = 0.5  # pause between attempts of the background loops while the store is down
LISTEN_POLL_S = 0.5  # the cancel listener's longest wait for a message before it looks at closing


@dataclass(frozen=True)
class Claim:
    fingerprint: str  # of the request body: another body under this id is a conflict
    owner: str  # the replica that runs the generation; "" once handed off for a takeover
    stream: bool
    state: str = RUNNING  # then the registry's final status: completed, failed, cancelled
    # Whether the creator's events carry `id:` lines; followers elsewhere frame theirs the same.
    # True when absent: claims written before this field existed were always numbered.
    numbered: bool = True
    epoch: int = 0  # how many takeovers the generation went through (0: its first producer)

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
class HeldClaim:
    """A claim as read, with its stored bytes: a takeover swaps it only if they are unchanged."""

    claim: Claim
    raw: bytes


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
    claim: Claim | None  # the claim when checked; None: not checked or gone

    @property
    def state(self) -> str | None:
        return None if self.claim is None else self.claim.state


# The owner's writes of one flush, as one script call, one group of arguments per generation.
# ARGV: max events per stream, the running TTL (ms), the number of groups; then per group: its
# request id, the claim its writer holds ("" for none: no check), and a header "FIRST COUNT NEW
# FIELD RECIPE KEPT END": the sequence of its first event, its number of events, 1 if its stream
# is new (set the running TTL), the events' field (d or x), and 1 for each extra that follows;
# then per event its data and token ids ("" for none); then the extras: the recipe, the kept
# count (carried by its first event), the end (final claim, answer or "", the answer's sequence,
# the TTL in ms of the keys after it). Few arguments per event, because redis-py builds each one
# in Python on the API process's event loop; keys are named here from the request id.
# A group whose claim is no longer the writer's (another replica took the generation over)
# writes nothing: the script returns the numbers of those groups, and their writer stops. A
# claim that vanished (a store restarted without persistence) is written back: nobody else
# holds it. In order, so a generation's end is written after its events.
DATA = b"d"  # field of one streamed event's data
TEXT = b"x"  # field of a text piece of a non-streaming generation
TOKENS = b"t"  # the token ids of an entry's text, packed
KEPT = b"k"  # ids logged before this entry that a takeover kept
BODY = b"b"  # field of a non-streaming answer: {"status", "body"}
APPEND_SCRIPT = f"""
local max_events, running_ttl = ARGV[1], ARGV[2]
local a = 4
local lost = {{}}
for g = 1, tonumber(ARGV[3]) do
  local id, held = ARGV[a], ARGV[a + 1]
  local first, count, new, field, has_recipe, has_kept, has_end =
    string.match(ARGV[a + 2], '(%d+) (%d+) (%d) (%a) (%d) (%d) (%d)')
  first, count = tonumber(first), tonumber(count)
  local stream, claim, recipe = '{PREFIX}events:' .. id, '{PREFIX}claim:' .. id, '{PREFIX}recipe:' .. id
  local extras = a + 3 + 2 * count
  local mine = true
  if held ~= '' then
    local now = redis.call('GET', claim)
    if not now then
      redis.call('SET', claim, held, 'PX', running_ttl)
    elseif now ~= held then
      mine = false
      lost[#lost + 1] = g
    end
  end
  local kept = ''
  if has_recipe == '1' then
    if mine then redis.call('SET', recipe, ARGV[extras], 'PX', running_ttl) end
    extras = extras + 1
  end
  if has_kept == '1' then
    kept = ARGV[extras]
    extras = extras + 1
  end
  if mine then
    for i = 0, count - 1 do
      local fields = {{field, ARGV[a + 3 + 2 * i]}}
      local ids = ARGV[a + 4 + 2 * i]
      if ids ~= '' then fields[#fields + 1] = '{TOKENS.decode()}'; fields[#fields + 1] = ids end
      if i == 0 and kept ~= '' then fields[#fields + 1] = '{KEPT.decode()}'; fields[#fields + 1] = kept end
      redis.call('XADD', stream, 'MAXLEN', '~', max_events, (first + i) .. '-0', unpack(fields))
    end
    if new == '1' then redis.call('PEXPIRE', stream, running_ttl) end
  end
  if has_end == '1' then
    if mine then
      local body = ARGV[extras + 1]
      if body ~= '' then redis.call('XADD', stream, ARGV[extras + 2] .. '-0', '{BODY.decode()}', body) end
      redis.call('PEXPIRE', stream, ARGV[extras + 3])
      redis.call('PEXPIRE', recipe, ARGV[extras + 3])
      redis.call('SET', claim, ARGV[extras], 'PX', ARGV[extras + 3])
    end
    extras = extras + 4
  end
  a = extras
end
return lost
"""
# A takeover: the claim becomes the taker's only if it is still exactly what the taker read, and
# its owner's heartbeat is gone (the lease lapsed, or it was handed off: owner "", whose key never
# exists) or still holds exactly the beat the taker saw (the CLIENT ID of a connection the store no
# longer has: if the owner came back on a new connection meanwhile, its beat differs and the take
# is refused). KEYS: the claim, the owner's heartbeat, the stream, the recipe. ARGV: the claim as
# read, the new claim, the TTL (ms) of all three from now, the beat seen ("": none).
# 1: taken; 0: someone else holds it, or its owner is back.
TAKE_SCRIPT = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local beat = redis.call('GET', KEYS[2])
if beat and beat ~= ARGV[4] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
redis.call('PEXPIRE', KEYS[3], ARGV[3])
redis.call('PEXPIRE', KEYS[4], ARGV[3])
return 1
"""


@dataclass
class AppendBatch:
    """One flush's arguments for APPEND_SCRIPT, and the commands it stands for."""

    args: list[bytes | str | int] = field(default_factory=list)
    commands: int = 0
    groups: list[str] = field(default_factory=list)  # the request id of each group, in order


class IdentityStore:
    def __init__(self, url: str, replica_id: str, metrics: Metrics) -> None:
        self.replica_id = replica_id
        self.metrics = metrics
        # Timeouts, retry and the waiting pool: shared/redis_client.py. Three clients, so that no
        # kind of command waits behind another: short commands; followers' blocking reads; and
        # the control connection (one, never shared) whose CLIENT ID the heartbeat publishes.
        self.client = redis_client(url)
        self.reads = redis_client(url, connections=READ_CONNECTIONS)
        self.control = redis_client(url, connections=1)
        self.listener = redis_client(url, connections=2, waiting=False)  # the cancel channel's PubSub
        trips = RoundTrips(metrics)
        self._trip = trips.trip
        self.heartbeat = Heartbeat(self.control, replica_id, trips)
        self._judge = LivenessJudge(self.client, trips)
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = asyncio.Event()
        self._scripts = {
            script: hashlib.sha1(script.encode()).hexdigest() for script in (APPEND_SCRIPT, TAKE_SCRIPT)
        }

    # --- claims -------------------------------------------------------------------------------
    async def claim(self, request_id: str, claim: Claim, ttl_s: float) -> Claim | None:
        """Make `claim` the id's claim unless one exists: None when this call won, else the
        existing claim (one atomic SET NX GET, so two replicas can never both win)."""
        async with self._trip("claim"):
            old = await self.client.set(claim_key(request_id), claim.encode(), nx=True, get=True, px=ms(ttl_s))
        return None if old is None else Claim.decode(old)

    async def get(self, request_id: str) -> Claim | None:
        held = await self.held(request_id)
        return None if held is None else held.claim

    async def held(self, request_id: str) -> HeldClaim | None:
        """The claim and its stored bytes (what a takeover must find unchanged)."""
        async with self._trip("get"):
            raw = await self.client.get(claim_key(request_id))
        if raw is None:
            return None
        return HeldClaim(Claim.decode(raw), raw if isinstance(raw, bytes) else raw.encode())

    async def take(self, request_id: str, held: HeldClaim, new: Claim, ttl_s: float, beat: bytes) -> bool:
        """Make `new` the claim if it is still `held` and its owner is still gone as `beat` said
        (TAKE_SCRIPT): of replicas that try at once, exactly one gets True."""
        keys = [
            claim_key(request_id),
            replica_key(held.claim.owner),
            events_key(request_id),
            recipe_key(request_id),
        ]
        async with self._trip("take", 4):
            taken = await self._run(TAKE_SCRIPT, keys, [held.raw, new.encode(), ms(ttl_s), beat])
        return bool(taken)

    # --- liveness (shared/replicas/liveness.py) ---------------------------------------------------
    async def liveness(self, replica_id: str) -> Liveness:
        """Whether `replica_id` runs: its heartbeat, then its connection."""
        return await self._judge.liveness(replica_id)

    async def alive(self, replica_id: str) -> bool:
        return (await self.liveness(replica_id)).alive

    async def log(self, request_id: str) -> tuple[list[tuple[int, dict[bytes, bytes]]], bytes | None]:
        """Every entry of a generation's stream, and its recipe (None: none was written)."""
        async with self._trip("log", 2), self.client.pipeline(transaction=False) as pipe:
            pipe.xrange(events_key(request_id), "-", "+")
            pipe.get(recipe_key(request_id))
            entries, recipe = await pipe.execute()
        return [(_sequence(entry_id), fields) for entry_id, fields in entries], recipe

    async def orphans(self, request_ids: list[str]) -> list[str]:
        """Those of `request_ids` whose generation runs and whose owner is gone (or handed it off)."""
        if not request_ids:
            return []
        async with self._trip("orphans", len(request_ids)):
            raws = await self.client.mget([claim_key(request_id) for request_id in request_ids])
        claims = {rid: Claim.decode(raw) for rid, raw in zip(request_ids, raws, strict=True) if raw is not None}
        running = {rid: claim for rid, claim in claims.items() if claim.running}
        owners = sorted({claim.owner for claim in running.values()})
        alive = {owner: (await self.liveness(owner)).alive for owner in owners}
        return [rid for rid, claim in running.items() if not alive[claim.owner]]

    async def release(self, request_id: str, refusal: BundleError | None = None) -> None:
        """Give up a claim whose generation never started (it was refused after the claim). The
        refusal stays readable for REFUSAL_TTL_S: a duplicate that came to follow the claim
        meanwhile answers what the owner answered (a 429 is a 429, not "events gone")."""
        async with self._trip("release"), self.client.pipeline(transaction=True) as pipe:
            if refusal is not None:
                pipe.set(refused_key(request_id), _refusal_record(refusal), ex=REFUSAL_TTL_S)
            pipe.delete(claim_key(request_id))
            await pipe.execute()

    async def refusal(self, request_id: str) -> BundleError | None:
        """The answer of a request refused after its claim, while it is kept (`release`)."""
        async with self._trip("refusal"):
            raw = await self.client.get(refused_key(request_id))
        return None if raw is None else _refusal_from(raw)

    # --- followers ----------------------------------------------------------------------------
    async def view(self, request_id: str, owner: str) -> StreamView:
        key = events_key(request_id)
        async with self._trip("view", 3), self.client.pipeline(transaction=False) as pipe:
            pipe.xrange(key, "-", "+", count=1)
            pipe.xrevrange(key, "+", "-", count=1)
            pipe.get(replica_key(owner))
            first, last, beat = await pipe.execute()
        alive = bool(owner) and (await self._judge.verdict(beat)).alive
        return StreamView(_first_sequence(first), _first_sequence(last), alive)

    async def read(self, request_id: str, after: int, owner: str | None) -> ReadStep:
        """Events after `after`, waiting up to READ_BLOCK_MS for some. With `owner`, the same
        round trip also refreshes this follower's presence and reads the owner's heartbeat and
        the claim (before the read, so 'alive and nothing came' means: nothing yet); whether the
        owner's connection stands is asked after it."""
        key = events_key(request_id)
        commands = 4 if owner is not None else 1
        async with (
            self._trip("read", commands, READ_BLOCK_MS / 1000),
            self.reads.pipeline(transaction=False) as pipe,
        ):
            if owner is not None:
                pipe.set(follow_key(request_id), b"1", px=ms(FOLLOW_TTL_S))
                pipe.get(replica_key(owner))
                pipe.get(claim_key(request_id))
            pipe.xread({key: f"{after}-0"}, count=4096, block=READ_BLOCK_MS)
            results = await pipe.execute()
        entries = [(_sequence(entry_id), fields) for _, batch in results[-1] for entry_id, fields in batch]
        if owner is None:
            return ReadStep(entries, None, None)
        raw_claim = results[2]
        alive = bool(owner) and (await self._judge.verdict(results[1])).alive
        return ReadStep(entries, alive, None if raw_claim is None else Claim.decode(raw_claim))

    async def followers_left_s(self, request_id: str) -> float:
        """Seconds until the last follower elsewhere lapses if it stops reading; 0: none."""
        async with self._trip("grace"):
            remaining_ms = await self.client.pttl(follow_key(request_id))
        return max(remaining_ms, 0) / 1000

    # --- writes (the owner) ---------------------------------------------------------------------
    async def append(self, batch: AppendBatch) -> list[str]:
        """One round trip, one command: every event and end of a flush, appended by a script.
        Returns the generations whose claim another replica holds now (nothing of theirs written).

        One XADD per event in a pipeline costs the API process ~23-28 us of CPU per event at 256
        streams (redis-py builds and parses each command in Python), the script ~7 us
        (`python -m bench.store_writes`, results/cpu/store-writes.txt); at 256 streams an
        event carries one token."""
        async with self._trip("write", batch.commands):
            lost = await self._run(APPEND_SCRIPT, [], batch.args)
        return [batch.groups[int(group) - 1] for group in lost]

    async def _run(self, script: str, keys: list[str], args: list[Any]) -> Any:
        try:
            return await self.client.evalsha(self._scripts[script], len(keys), *keys, *args)
        except NoScriptError:  # a new or restarted server: load it once, then again by hash
            self._scripts[script] = await self.client.script_load(script)
            return await self.client.evalsha(self._scripts[script], len(keys), *keys, *args)

    # --- cancel -------------------------------------------------------------------------------
    async def publish_cancel(self, owner: str, request_id: str) -> None:
        async with self._trip("cancel"):
            await self.client.publish(cancel_channel(owner), request_id.encode())

    # --- background: heartbeat and cancel listener -----------------------------------------------
    def start(self, on_cancel: Callable[[str], None]) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self.heartbeat.run()), loop.create_task(self._listen(on_cancel))]

    async def _listen(self, on_cancel: Callable[[str], None]) -> None:
        """Relay cancels sent to this replica. It ends by itself once `aclose` says so (within one
        LISTEN_POLL_S), never by cancellation: redis-py waits, uncancellably, for a cancelled
        PubSub's teardown, and a task stuck there would hold up the process's exit."""
        while not self._closing.is_set():
            try:
                async with self.listener.pubsub() as pubsub:
                    await pubsub.subscribe(cancel_channel(self.replica_id))
                    while not self._closing.is_set():
                        message = await pubsub.get_message(
                            ignore_subscribe_messages=True, timeout=LISTEN_POLL_S
                        )
                        if message is not None and message.get("type") == "message":
                            on_cancel(message["data"].decode())
            except (RedisError, OSError) as exc:
                self.metrics.store_errors.labels("listen", error_kind(exc)).inc()
                log.debug("cancel channel lost (%s); subscribing again", exc)
            except Exception:  # a dead listener would leave cancels sent from elsewhere unheard
                self.metrics.store_errors.labels("listen", "unexpected").inc()
                log.exception("cancel channel failed unexpectedly; subscribing again")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), RECONNECT_S)

    async def aclose(self) -> None:
        self._closing.set()  # the listener ends by itself (`_listen`); the heartbeat is cancelled
        heartbeat, listener = self._tasks or (None, None)
        if heartbeat is not None:
            heartbeat.cancel()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CLOSE_BOUND_S):
                await asyncio.gather(*self._tasks, return_exceptions=True)
        if listener is not None and not listener.done():  # not out of redis-py in time: cancelled
            listener.cancel()
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            async with asyncio.timeout(CLOSE_BOUND_S):
                await self.client.delete(self.heartbeat.key)  # followers learn at once
        for client in (self.control, self.listener, self.reads, self.client):
            # Bounded: closing waits for each socket to close, and shutdown must not wait on a
            # store that stopped answering (the process's exit closes what is left).
            with contextlib.suppress(RedisError, OSError, TimeoutError):
                async with asyncio.timeout(CLOSE_BOUND_S):
                    await client.aclose()


def _sequence(entry_id: bytes) -> int:
    return int(entry_id.split(b"-", 1)[0])


def _first_sequence(entries: list[tuple[bytes, Any]]) -> int | None:
    return _sequence(entries[0][0]) if entries else None


def _refusal_record(refusal: BundleError) -> bytes:
    retry_after_s = refusal.retry_after_s if isinstance(refusal, Overloaded) else None
    return orjson.dumps(
        {"status": refusal.status_code, "body": refusal.to_openai(), "retry_after_s": retry_after_s}
    )


def _refusal_from(raw: bytes | str) -> BundleError:
    """The refusal as the owner raised it: a 429 keeps its Retry-After."""
    record = orjson.loads(raw)
    if record["retry_after_s"] is not None:
        message = str((record["body"].get("error") or {}).get("message", "overloaded"))
        return Overloaded(message, retry_after_s=int(record["retry_after_s"]))
    return StoredError(int(record["status"]), record["body"])
