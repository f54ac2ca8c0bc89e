"""The identity store at full load and at a replica's death, against a real valkey-server (no engine).

Why requests with ids failed with 503 while the store was up (issue "Full load keeps every
promise"), each cause shown on redis-py as it comes and on the client that shared/redis_client.py
builds:
- the default pool raises MaxConnectionsError past 100 connections instead of waiting;
- a timeout that runs on the event loop's clock fires when the loop itself was busy, although the
  answer had arrived.
Then liveness: a killed replica is seen dead by its closed connection, well before its lease
lapses; a frozen one (SIGSTOP, sockets open) is not; and a store that refuses CLIENT commands
falls back to the lease alone, saying so.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis.asyncio
from redis.exceptions import MaxConnectionsError

from shared.errors import StoreUnavailable
from shared.obs.metrics import Metrics
from shared.redis_client import POOL_CONNECTIONS, AnswerClock, answer_bound, redis_client
from shared.replicas import liveness as liveness_module
from shared.replicas import round_trips as round_trips_module
from shared.replicas.liveness import HEARTBEAT_TTL_S, LEASE_ONLY
from shared.replicas.store import IdentityStore
from shared.replicas.store_keys import replica_key
from tests.redis_server import RedisServer

BURST = 300  # commands in flight at once: past redis-py's default pool of 100


async def test_a_burst_past_the_default_pool_fails_there_and_waits_on_ours(redis_server: RedisServer) -> None:
    default = redis.asyncio.Redis.from_url(redis_server.url)
    ours = redis_client(redis_server.url)
    try:
        before = len(await ours.client_list())  # other tests' clients, and ours for this question
        failed = await asyncio.gather(
            *(default.set(f"burst:{n}", b"1") for n in range(BURST)), return_exceptions=True
        )
        assert any(isinstance(outcome, MaxConnectionsError) for outcome in failed)  # the cause
        await default.aclose()
        answers = await asyncio.gather(*(ours.set(f"burst:{n}", b"1") for n in range(BURST)))
        assert answers == [True] * BURST
        assert len(await ours.client_list()) - before < POOL_CONNECTIONS  # bounded: they waited
    finally:
        await default.aclose()
        await ours.aclose()


def _stall_loop(seconds: float) -> None:
    time.sleep(seconds)  # the event loop does nothing else meanwhile: a busy API process


async def _stalled_round_trip(client: redis.asyncio.Redis, bounded: Callable[[], Any]) -> Any:
    """A read the store answers after 0.1 s (XREAD BLOCK on an empty stream) under `bounded()`,
    with this loop stalled for 1 s from 0.02 s on: the answer arrives while the loop is busy."""

    async def read() -> Any:
        async with bounded():
            return await client.xread({"stall-stream": "$"}, block=100)

    task = asyncio.get_running_loop().create_task(read())
    asyncio.get_running_loop().call_later(0.02, _stall_loop, 1.0)
    return await task


async def test_a_stalled_loop_trips_a_plain_timeout_but_not_the_answer_bound(redis_server: RedisServer) -> None:
    """The store answers in 0.1 s, but the loop is blocked for 1 s meanwhile: a 0.3 s timeout on
    the loop's clock fires before the task sees its answer; the answer bound sees that its own
    timer ran late, and waits on."""
    client = redis_client(redis_server.url)
    await client.ping()  # a connection is open: one send and one read below
    try:
        with pytest.raises(TimeoutError):
            await _stalled_round_trip(client, lambda: asyncio.timeout(0.3))
        slow: list[int] = []
        answer = await _stalled_round_trip(
            client, lambda: answer_bound(0.3, AnswerClock(), lambda: slow.append(1))
        )
        assert answer == [] and slow  # answered (nothing came), counted as slow, not failed
    finally:
        await client.aclose()


async def test_a_store_that_answers_nothing_is_unavailable_after_the_bound(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGSTOP on the server: its sockets stay open and nothing answers, as with a hung store."""
    monkeypatch.setattr(round_trips_module, "ANSWER_BOUND_S", 0.5)
    metrics = Metrics()
    store = IdentityStore(redis_server.url, "asks-a-frozen-store", metrics)
    await store.client.ping()
    assert redis_server.process is not None
    redis_server.process.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(StoreUnavailable, match="no_answer"):
            await store.get("anything")
    finally:
        redis_server.process.send_signal(signal.SIGCONT)
    assert metrics.store_errors.labels("get", "no_answer")._value.get() == 1
    assert await store.get("anything") is None  # answered again once the store runs
    await store.aclose()


# --- liveness: a replica in another process ---------------------------------------------------------
REPLICA = """
import asyncio, sys
from shared.replicas.store import IdentityStore
from shared.obs.metrics import Metrics

async def main():
    store = IdentityStore(sys.argv[1], sys.argv[2], Metrics())
    store.start(on_cancel=lambda _: None)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def _replica_process(url: str, name: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(REPLICA), url, name], stdin=subprocess.DEVNULL
    )


async def _until_beating(store: IdentityStore, name: str) -> None:
    async with asyncio.timeout(60):
        while not await store.client.exists(replica_key(name)):
            await asyncio.sleep(0.05)


async def test_a_killed_replica_is_dead_at_once_and_a_frozen_one_is_alive(redis_server: RedisServer) -> None:
    store = IdentityStore(redis_server.url, "watcher", Metrics())
    replica = _replica_process(redis_server.url, "watched")
    try:
        await _until_beating(store, "watched")
        assert (await store.liveness("watched")).alive
        os.kill(replica.pid, signal.SIGSTOP)  # frozen: its connections stand, its beats stop
        await asyncio.sleep(3 * liveness_module.HEARTBEAT_EVERY_S)
        assert (await store.liveness("watched")).alive
        os.kill(replica.pid, signal.SIGKILL)
        killed = time.monotonic()
        while (verdict := await store.liveness("watched")).alive:
            await asyncio.sleep(0.01)
        seen_after = time.monotonic() - killed
    finally:
        replica.kill()
        replica.wait(30)
    assert verdict.cause == "connection" and verdict.beat.startswith(b"c:")
    assert seen_after < HEARTBEAT_TTL_S / 2  # its connection, not its lease (lapsing after 10 s)
    assert await store.client.exists(replica_key("watched"))  # the lease still stands
    await store.aclose()


@pytest.fixture
def store_without_client_commands(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A server that refuses CLIENT commands, as some managed Redis services do."""
    server = RedisServer(tmp_path_factory.mktemp("redis-no-client"), "--rename-command", "CLIENT", "")
    server.start()
    yield server
    server.stop()


async def test_a_store_refusing_client_commands_falls_back_to_the_lease_and_says_so(
    store_without_client_commands: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    url = store_without_client_commands.url
    store = IdentityStore(url, "lease-only", Metrics())
    with caplog.at_level(logging.WARNING, logger=liveness_module.__name__):
        store.start(on_cancel=lambda _: None)
        await _until_beating(store, "lease-only")
    assert store.heartbeat.watch_connections is False
    assert await store.client.get(replica_key("lease-only")) == LEASE_ONLY
    (line,) = [r.getMessage() for r in caplog.records if "refuses CLIENT" in r.getMessage()]
    assert f"{HEARTBEAT_TTL_S:g} s heartbeat lease" in line
    replica = _replica_process(url, "lease-only-killed")
    try:
        await _until_beating(store, "lease-only-killed")
    finally:
        replica.kill()
        replica.wait(30)
    assert (await store.liveness("lease-only-killed")).alive  # only its lease can tell, later
    await store.client.delete(replica_key("lease-only-killed"))  # the lease lapsed (skip the wait)
    assert (await store.liveness("lease-only-killed")).cause == "lease"
    await store.aclose()
