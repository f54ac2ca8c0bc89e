"""Where stored responses live: this process's memory, or Redis when replicas share one.

A record is what a later request needs about a response: the request (to rebuild its events and
its chat body on any replica), the conversation before it (`previous_response_id` chains), and
the Response object as last known (final once the generation ended).

Both stores are bounded the same way: a record lives `responses_retention_s`, at most
`responses_max_stored` are kept (oldest dropped first), and one record holds at most
`responses_max_record_bytes`; so the bytes held are bounded by the product of the last two.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, Protocol

import orjson

from shared.errors import EventsGone, NotFound, StoreUnavailable
from shared.redis_client import AnswerClock, answer_bound, redis_client
from shared.settings import Settings

Record = dict[str, Any]
PREFIX = "bundle:response:"
INDEX_KEY = "bundle:responses"  # sorted set of stored ids by time stored (the count bound)
# Sorted set of background responses not yet ended, by time created: what replicas adopt when the
# one running a response is lost (shared/responses/manager.py).
RUNNING_KEY = "bundle:responses:running"
ANSWER_BOUND_S = 10.0  # no answer to this process for this long, its loop on time: unreachable


class ResponseStore(Protocol):
    async def get(self, response_id: str) -> Record | None: ...

    async def put(self, response_id: str, record: Record) -> None: ...

    async def update(self, response_id: str, record: Record) -> bool: ...

    async def delete(self, response_id: str) -> bool: ...

    async def mark_running(self, response_id: str) -> None:
        """A background response started: list it for adoption until it ends."""
        ...

    async def running(self, limit: int) -> list[str]:
        """Background responses listed as not ended, oldest first."""
        ...

    async def forget_running(self, response_id: str) -> None: ...

    async def aclose(self) -> None: ...


def encode(record: Record, limit: int) -> bytes:
    """The stored bytes; a record over the limit is kept as a marker that says so."""
    raw = orjson.dumps(record)
    if len(raw) > limit:
        return orjson.dumps({"id": record.get("id"), "too_large": len(raw)})
    return raw


def decode(raw: bytes, limit: int) -> Record:
    record: Record = orjson.loads(raw)
    if "too_large" in record:
        raise EventsGone(
            f"response {record.get('id')!r} was {record['too_large']} bytes, over the "
            f"{limit}-byte limit of one stored response (BUNDLE_RESPONSES_MAX_RECORD_BYTES); it was not kept",
            code="response_too_large",
        )
    return record


def not_found(response_id: str, settings: Settings) -> NotFound:
    return NotFound(
        f"no response with id {response_id!r} is stored: it was never created here, was deleted, or "
        f"expired after the retention of {settings.responses_retention_s:g} s (BUNDLE_RESPONSES_RETENTION_S)",
        param="response_id",
    )


class MemoryStore:
    """One process's records (no BUNDLE_REDIS_URL): visible to this replica only."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._records: OrderedDict[str, tuple[float, bytes]] = OrderedDict()

    async def get(self, response_id: str) -> Record | None:
        self._evict()
        held = self._records.get(response_id)
        return None if held is None else decode(held[1], self._settings.responses_max_record_bytes)

    async def put(self, response_id: str, record: Record) -> None:
        raw = encode(record, self._settings.responses_max_record_bytes)
        stored_at = self._records.pop(response_id, (time.monotonic(), b""))[0]
        self._records[response_id] = (stored_at, raw)
        self._records.move_to_end(response_id)
        self._evict()

    async def update(self, response_id: str, record: Record) -> bool:
        """Replace a record still held (its age unchanged); False, and nothing stored, if it
        was deleted or expired meanwhile: a late save must not bring a deleted response back."""
        self._evict()
        if response_id not in self._records:
            return False
        await self.put(response_id, record)
        return True

    async def delete(self, response_id: str) -> bool:
        return self._records.pop(response_id, None) is not None

    # One process: a response whose process died is gone with it, and nobody else could adopt it.
    async def mark_running(self, response_id: str) -> None:
        pass

    async def running(self, limit: int) -> list[str]:
        return []

    async def forget_running(self, response_id: str) -> None:
        pass

    async def aclose(self) -> None:
        self._records.clear()

    def _evict(self) -> None:
        horizon = time.monotonic() - self._settings.responses_retention_s
        while self._records:
            oldest_id, (stored_at, _) = next(iter(self._records.items()))
            if stored_at >= horizon and len(self._records) <= self._settings.responses_max_stored:
                return
            del self._records[oldest_id]


class RedisStore:
    """Records in the Redis/Valkey server the replicas share: any replica reads any response."""

    def __init__(self, settings: Settings) -> None:
        assert settings.redis_url is not None
        self._settings = settings
        self._redis = redis_client(settings.redis_url.get_secret_value())  # imports redis-py only now
        self._clock = AnswerClock()
        self._ttl_ms = max(int(settings.responses_retention_s * 1000), 1)

    async def get(self, response_id: str) -> Record | None:
        raw = await self._call(self._redis.get(PREFIX + response_id))
        return None if raw is None else decode(raw, self._settings.responses_max_record_bytes)

    async def put(self, response_id: str, record: Record) -> None:
        raw = encode(record, self._settings.responses_max_record_bytes)
        now = time.time()
        pipe = self._redis.pipeline(transaction=True)
        pipe.set(PREFIX + response_id, raw, px=self._ttl_ms)
        pipe.zadd(INDEX_KEY, {response_id: now}, nx=True)  # first stored: its place in the count bound
        pipe.zremrangebyscore(INDEX_KEY, "-inf", now - self._settings.responses_retention_s)
        pipe.zcard(INDEX_KEY)
        count = (await self._call(pipe.execute()))[-1]
        over = int(count) - self._settings.responses_max_stored
        if over > 0:
            oldest = await self._call(self._redis.zpopmin(INDEX_KEY, over))
            if oldest:
                await self._call(self._redis.delete(*(PREFIX + member.decode() for member, _ in oldest)))

    async def update(self, response_id: str, record: Record) -> bool:
        """Replace a record still held, keeping its TTL (so it expires when its place in the
        count index does); False, and nothing stored, if it was deleted or expired meanwhile."""
        raw = encode(record, self._settings.responses_max_record_bytes)
        done = await self._call(self._redis.set(PREFIX + response_id, raw, xx=True, keepttl=True))
        return bool(done)

    async def delete(self, response_id: str) -> bool:
        pipe = self._redis.pipeline(transaction=True)
        pipe.delete(PREFIX + response_id)
        pipe.zrem(INDEX_KEY, response_id)
        removed = (await self._call(pipe.execute()))[0]
        return bool(removed)

    async def mark_running(self, response_id: str) -> None:
        await self._call(self._redis.zadd(RUNNING_KEY, {response_id: time.time()}))

    async def running(self, limit: int) -> list[str]:
        horizon = time.time() - self._settings.responses_retention_s
        await self._call(self._redis.zremrangebyscore(RUNNING_KEY, "-inf", horizon))
        members = await self._call(self._redis.zrange(RUNNING_KEY, 0, limit - 1))
        return [member.decode() for member in members]

    async def forget_running(self, response_id: str) -> None:
        await self._call(self._redis.zrem(RUNNING_KEY, response_id))

    async def aclose(self) -> None:
        await self._redis.aclose()

    async def _call(self, call: Any) -> Any:
        from redis.exceptions import RedisError

        try:
            async with answer_bound(ANSWER_BOUND_S, self._clock):  # silence, not a busy loop, fails it
                answer = await call
        except (RedisError, OSError, TimeoutError) as exc:
            raise StoreUnavailable(f"the response store is unreachable: {type(exc).__name__}") from None
        self._clock.answered()
        return answer


def open_store(settings: Settings) -> ResponseStore:
    return RedisStore(settings) if settings.redis_url is not None else MemoryStore(settings)
