"""The shared identity store: request claims, replica heartbeats, the cancel channel and the event
streams of every replica, in one Redis (or Valkey) database.

Keys, one deployment per database (a second deployment uses another: redis://host/1):
  bundle:claim:{id}       JSON {fp, owner, stream, state, numbered, epoch}; SET NX makes the first
                          replica the owner; a takeover (shared/replicas/takeover.py) swaps the owner
                          and bumps the epoch; owner "" means handed off (anyone may take it over)
  bundle:events:{id}      a Stream; entry id "<seq>-0", field d = one SSE event's data, x = a text
                          piece of a non-streaming generation, b = a whole non-streaming answer or
                          the 4xx of a refused request ({status, body}); t = the token ids whose
                          text the entry carries (uint32 little-endian), k = how many ids logged
                          before it a takeover kept (the rest were generated again)
  bundle:recipe:{id}      JSON: what a takeover needs to continue the generation (prompt token ids,
                          sampling parameters, the chunks' id and creation time)
  bundle:follow:{id}      exists while a follower on some replica reads (refreshed, short expiry)
  bundle:replica:{rid}    a replica's heartbeat (refreshed, short expiry)
  bundle:cancel:{rid}     pub/sub channel: ids the replica `rid` must abort

Every round trip goes through `_trip`, which times it, counts its commands for /metrics and turns
a failure into `StoreUnavailable` (HTTP 503): a refused or broken connection at once, and no answer
only past ANSWER_BOUND_S of silence from the store while this process's loop ran on time
(shared/redis_client.py `answer_bound`): a queued or slow round trip is counted as slow, never
failed. redis-py reconnects on the next command, so the bundle recovers without a restart when
the server comes back.

Liveness. A replica holds one connection of its own (the control connection) and writes that
connection's CLIENT ID into its heartbeat key every HEARTBEAT_EVERY_S. Another replica counts it
dead when the key is gone (the lease, HEARTBEAT_TTL_S: what no socket shows, a frozen or cut-off
host) or when that connection is no longer in the store's CLIENT LIST (a process that dies, is
killed or runs out of memory closes its sockets at once: seen within DEATH_SEEN_BOUND_S). A process
that is alive but slow (a late event loop, a starved CPU, a pause under SIGSTOP) keeps its socket
open, so it is never taken for dead before its lease lapses. Stores that refuse CLIENT ID or
CLIENT LIST (some managed services) leave the lease alone: one line at start says so.
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
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.errors import StoreUnavailable
from shared.obs.metrics import Metrics
from shared.redis_client import AnswerClock, answer_bound, redis_client

log = logging.getLogger(__name__)

PREFIX = "bundle:"
RUNNING = "running"
# Liveness (module docstring). The lease: a heartbeat every HEARTBEAT_EVERY_S lapses HEARTBEAT_TTL_S
# after the last one; long, because it only stands in for what a socket cannot show (a frozen or
# partitioned host), and a live replica whose loop ran seconds late must not lose it. A follower
# blocks at most READ_BLOCK_MS per read and checks the owner after every idle read (while events
# flow, every CHECK_EVERY_S); whether the owner's connection stands is asked at most every
# CONNECTION_FRESH_S per process. So a dead owner's connection is found gone within
# DEATH_SEEN_BOUND_S (the read in flight, then one more with a cached answer); a lapsed lease within
# PRODUCER_LOST_BOUND_S.
HEARTBEAT_EVERY_S = 1.0
HEARTBEAT_TTL_S = 10.0
READ_BLOCK_MS = 200  # a follower's blocking read: it holds a connection of the read pool meanwhile
CHECK_EVERY_S = 0.25
CONNECTION_FRESH_S = 0.05
DEATH_SEEN_BOUND_S = 2 * READ_BLOCK_MS / 1000 + CONNECTION_FRESH_S  # 0.45 s
PRODUCER_LOST_BOUND_S = HEARTBEAT_TTL_S + 2 * READ_BLOCK_MS / 1000  # 10.4 s
FOLLOW_TTL_S = 3.0  # a follower that stopped refreshing no longer holds the generation open
# No answer from the store to this process for this long, while its loop ran on time: unreachable.
ANSWER_BOUND_S = 5.0
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


def claim_key(request_id: str) -> str:
    return f"{PREFIX}claim:{request_id}"


def events_key(request_id: str) -> str:
    return f"{PREFIX}events:{request_id}"


def follow_key(request_id: str) -> str:
    return f"{PREFIX}follow:{request_id}"


def recipe_key(request_id: str) -> str:
    return f"{PREFIX}recipe:{request_id}"


def replica_key(replica_id: str) -> str:
    return f"{PREFIX}replica:{replica_id}"


def cancel_channel(replica_id: str) -> str:
    return f"{PREFIX}cancel:{replica_id}"


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
        self.clock = AnswerClock()
        # None until the first beat found out whether the store answers CLIENT ID / CLIENT LIST.
        self.watch_connections: bool | None = None
        self._connected: dict[int, tuple[float, bool]] = {}  # CLIENT ID -> (when asked, listed)
        self._asking: dict[int, asyncio.Future[bool]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = asyncio.Event()
        self._scripts = {
            script: hashlib.sha1(script.encode()).hexdigest() for script in (APPEND_SCRIPT, TAKE_SCRIPT)
        }

    # --- accounting ---------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _trip(self, op: str, commands: int = 1, blocks_s: float = 0.0) -> AsyncIterator[None]:
        """One round trip: counted, timed, bounded (ANSWER_BOUND_S of silence, on top of a blocking
        read's own `blocks_s`), and failed as StoreUnavailable naming what went wrong."""
        self.metrics.store_round_trips.labels(op).inc()
        self.metrics.store_commands.labels(op).inc(commands)
        started = time.perf_counter()
        try:
            async with answer_bound(
                ANSWER_BOUND_S + blocks_s, self.clock, self.metrics.store_slow.labels(op).inc
            ):
                yield
        except (RedisError, OSError, TimeoutError) as exc:
            kind = _error_kind(exc)
            self.metrics.store_errors.labels(op, kind).inc()
            raise StoreUnavailable(
                f"the shared request-identity store (Redis) is unavailable ({type(exc).__name__}: "
                f"{kind}); requests with X-Request-Id cannot be served now, requests without one can"
            ) from exc
        else:
            self.clock.answered()
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
            taken = await self._run(TAKE_SCRIPT, keys, [held.raw, new.encode(), _ms(ttl_s), beat])
        return bool(taken)

    # --- liveness -----------------------------------------------------------------------------
    async def liveness(self, replica_id: str) -> Liveness:
        """Whether `replica_id` runs (module docstring): its heartbeat, then its connection."""
        if not replica_id:
            return Liveness(False, "handoff")
        async with self._trip("alive"):
            beat = await self.client.get(replica_key(replica_id))
        return await self._judge(beat)

    async def alive(self, replica_id: str) -> bool:
        return (await self.liveness(replica_id)).alive

    async def _judge(self, beat: bytes | str | None) -> Liveness:
        """A heartbeat's verdict: none is a lapsed lease; a connection's id must still be listed."""
        if beat is None:
            return Liveness(False, "lease")
        if isinstance(beat, str):  # a client that decodes answers (never this module's)
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
            async with self._trip("connected"):
                listed = bool(await self.client.client_list(client_id=[client_id]))
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
            pipe.get(replica_key(owner))
            first, last, beat = await pipe.execute()
        alive = bool(owner) and (await self._judge(beat)).alive
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
                pipe.set(follow_key(request_id), b"1", px=_ms(FOLLOW_TTL_S))
                pipe.get(replica_key(owner))
                pipe.get(claim_key(request_id))
            pipe.xread({key: f"{after}-0"}, count=4096, block=READ_BLOCK_MS)
            results = await pipe.execute()
        entries = [(_sequence(entry_id), fields) for _, batch in results[-1] for entry_id, fields in batch]
        if owner is None:
            return ReadStep(entries, None, None)
        raw_claim = results[2]
        alive = bool(owner) and (await self._judge(results[1])).alive
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
        self._tasks = [loop.create_task(self._heartbeat()), loop.create_task(self._listen(on_cancel))]

    async def _heartbeat(self) -> None:
        while True:
            try:
                await self._beat()
            except StoreUnavailable:
                pass  # counted in /metrics; retried next beat
            except Exception:  # a dead heartbeat task would declare this live replica dead
                self.metrics.store_errors.labels("heartbeat", "unexpected").inc()
                log.exception("heartbeat to the identity store failed unexpectedly; retrying")
            await asyncio.sleep(HEARTBEAT_EVERY_S)

    async def _beat(self) -> None:
        """Write the lease, naming the control connection it stands on (its CLIENT ID)."""
        if self.watch_connections is None:
            self.watch_connections = await self._can_watch_connections()
        beat = LEASE_ONLY
        if self.watch_connections:
            async with self._trip("heartbeat"):
                beat = CONNECTION_BEAT + str(await self.control.client_id()).encode()
        async with self._trip("heartbeat"):
            await self.control.set(replica_key(self.replica_id), beat, px=_ms(HEARTBEAT_TTL_S))

    async def _can_watch_connections(self) -> bool:
        """Whether the store answers CLIENT ID and CLIENT LIST ID (said once, in one line)."""
        try:
            async with self._trip("heartbeat", 2):
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
                self.metrics.store_errors.labels("listen", _error_kind(exc)).inc()
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
                await self.client.delete(replica_key(self.replica_id))  # followers learn at once
        for client in (self.control, self.listener, self.reads, self.client):
            # Bounded: closing waits for each socket to close, and shutdown must not wait on a
            # store that stopped answering (the process's exit closes what is left).
            with contextlib.suppress(RedisError, OSError, TimeoutError):
                async with asyncio.timeout(CLOSE_BOUND_S):
                    await client.aclose()


def _error_kind(exc: BaseException) -> str:
    """What failed, for /metrics: `unreachable` (refused or broken connection), `no_answer`
    (ANSWER_BOUND_S of silence), or `error` (the store answered with an error)."""
    if isinstance(exc, TimeoutError | RedisTimeoutError):
        return "no_answer"
    if isinstance(exc, RedisConnectionError | OSError):
        return "unreachable"
    return "error"


def _ms(seconds: float) -> int:
    return max(int(seconds * 1000), 1)


def _sequence(entry_id: bytes) -> int:
    return int(entry_id.split(b"-", 1)[0])


def _first_sequence(entries: list[tuple[bytes, Any]]) -> int | None:
    return _sequence(entries[0][0]) if entries else None
