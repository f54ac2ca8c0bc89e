"""The stored-response bounds (count, bytes, retention) of both stores: this process's memory, and
a real Redis-protocol server (tests/redis_server.py). No engine."""

from __future__ import annotations

import asyncio

import pytest

from shared.errors import EventsGone
from shared.responses.store import MemoryStore, RedisStore, ResponseStore
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


async def test_records_expire_after_the_retention(redis_server: RedisServer) -> None:
    for store in stores(redis_server, responses_retention_s=0.3):
        name = f"resp_old_{type(store).__name__}"
        await store.put(name, record(name))
        assert await store.get(name) is not None
        await asyncio.sleep(0.5)
        assert await store.get(name) is None
        await store.aclose()


async def test_an_update_never_brings_a_deleted_record_back_and_keeps_its_age(
    redis_server: RedisServer,
) -> None:
    for store in stores(redis_server, responses_retention_s=0.8):
        name = f"resp_update_{type(store).__name__}"
        assert await store.update(name, record(name)) is False and await store.get(name) is None
        await store.put(name, record(name))
        await asyncio.sleep(0.5)
        assert await store.update(name, record(name, size=20)) is True
        assert (await store.get(name) or {}).get("history") == ["x" * 20]
        await asyncio.sleep(0.5)  # 1.0 s after the put: expired, though updated 0.5 s ago
        assert await store.get(name) is None
        await store.put(name, record(name))
        assert await store.delete(name) is True
        assert await store.update(name, record(name)) is False and await store.get(name) is None
        await store.aclose()
