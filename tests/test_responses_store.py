"""The stored-response bounds (count, bytes, retention) of both stores: this process's memory, and
a real Redis-protocol server (tests/redis_server.py). No engine."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from shared.errors import EventsGone
from shared.responses import records as store_module
from shared.responses.records import MemoryStore, RedisStore, ResponseStore
from shared.settings import Settings
from tests.redis_server import RedisServer


def settings(**overrides: object) -> Settings:
    return Settings(responses_max_stored=3, responses_max_record_bytes=2048, **overrides)  # type: ignore[arg-type]


def stores(redis: RedisServer, **overrides: object) -> list[ResponseStore]:
    return [MemoryStore(settings(**overrides)), RedisStore(settings(redis_url=redis.url, **overrides))]


def record(response_id: str, size: int = 10) -> dict[str, object]:
    return {"id": response_id, "history": ["x" * size], "response": {"status": "completed"}}


async def test_the_oldest_go_beyond_the_count_and_delete_removes(redis_server: RedisServer) -> None:
    for store in stores(redis_server):
        names = [f"resp_count_{type(store).__name__}_{i}" for i in range(5)]
        for name in names:
            await store.put(name, record(name))
        assert [await store.get(name) is not None for name in names] == [False, False, True, True, True]
        assert await store.delete(names[-1]) is True and await store.get(names[-1]) is None
        assert await store.delete(names[-1]) is False
        await store.aclose()


async def test_a_record_over_the_byte_limit_is_a_clear_410(redis_server: RedisServer) -> None:
    for store in stores(redis_server):
        name = f"resp_big_{type(store).__name__}"
        await store.put(name, record(name, size=5000))
        with pytest.raises(EventsGone) as gone:
            await store.get(name)
        assert gone.value.code == "response_too_large" and "2048-byte limit" in gone.value.message
        await store.aclose()


class Clock:
    """A stand-in for the `time` module in shared/responses/records.py: the memory store's ages
    then move only when the test says, so no margin of a few tenths of a second is raced."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(store_module, "time", clock)
    return clock


# The Redis server expires keys on its own clock: a retention long against one call (~ms) but
# short for the suite. Expiry is only ever checked from below (never gone before the retention).
REDIS_RETENTION_S = 2.0


async def gone_after(store: ResponseStore, name: str, since: float) -> float:
    """Poll until the record is gone; the seconds since `since` (time.monotonic) when it was."""
    deadline = since + 60
    while await store.get(name) is not None:
        assert time.monotonic() < deadline, f"{name} never expired"
        await asyncio.sleep(0.05)
    return time.monotonic() - since


async def test_records_expire_after_the_retention_in_memory(clock: Clock) -> None:
    store = MemoryStore(settings(responses_retention_s=0.3))
    await store.put("resp_old", record("resp_old"))
    clock.now += 0.29
    assert await store.get("resp_old") is not None
    clock.now += 0.02
    assert await store.get("resp_old") is None


async def test_records_expire_after_the_retention_in_redis(redis_server: RedisServer) -> None:
    store = RedisStore(settings(redis_url=redis_server.url, responses_retention_s=REDIS_RETENTION_S))
    put_at = time.monotonic()
    await store.put("resp_old", record("resp_old"))
    assert await store.get("resp_old") is not None
    assert await gone_after(store, "resp_old", put_at) >= REDIS_RETENTION_S
    await store.aclose()


async def test_an_update_in_memory_never_brings_a_deleted_record_back_and_keeps_its_age(clock: Clock) -> None:
    store = MemoryStore(settings(responses_retention_s=0.8))
    name = "resp_update"
    assert await store.update(name, record(name)) is False and await store.get(name) is None
    await store.put(name, record(name))
    clock.now += 0.5
    assert await store.update(name, record(name, size=20)) is True
    assert (await store.get(name) or {}).get("history") == ["x" * 20]
    clock.now += 0.5  # 1.0 s after the put: expired, though updated 0.5 s ago
    assert await store.get(name) is None
    await assert_no_resurrection(store, name)
    await store.aclose()


async def test_an_update_in_redis_never_brings_a_deleted_record_back_and_keeps_its_age(
    redis_server: RedisServer,
) -> None:
    store = RedisStore(settings(redis_url=redis_server.url, responses_retention_s=REDIS_RETENTION_S))
    raw = redis.Redis.from_url(redis_server.url)
    name = "resp_update"
    assert await store.update(name, record(name)) is False and await store.get(name) is None
    put_at = time.monotonic()
    await store.put(name, record(name))
    await asyncio.sleep(0.5)  # an age to keep: the key's time to live has gone down from 2,000 ms
    left_before = raw.pttl(store_module.PREFIX + name)
    assert await store.update(name, record(name, size=20)) is True
    assert (await store.get(name) or {}).get("history") == ["x" * 20]
    assert 0 < raw.pttl(store_module.PREFIX + name) <= left_before  # not renewed by the update
    assert await gone_after(store, name, put_at) >= REDIS_RETENTION_S
    await assert_no_resurrection(store, name)
    raw.close()
    await store.aclose()


async def assert_no_resurrection(store: ResponseStore, name: str) -> None:
    await store.put(name, record(name))
    assert await store.delete(name) is True
    assert await store.update(name, record(name)) is False and await store.get(name) is None
