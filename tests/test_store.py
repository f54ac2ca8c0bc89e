"""The shared identity store against a real Redis-protocol server (tests/redis_server.py), no vLLM:
atomic claims, batched stream writes, byte-identical following, gaps and dead owners; then two
`Service`s ("replicas" in one process, each with a scripted engine) sharing one server: one
generation per id, conflicts, cancel from the other replica, the grace window counting readers
elsewhere, and a store outage. The real two-process, real-engine proof is tests/test_replicas.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

import orjson
import pytest

from shared.errors import (
    EventsGone,
    IdempotencyConflict,
    InvalidRequest,
    Overloaded,
    ProducerLost,
    StoredError,
    StoreUnavailable,
)
from shared.generation.replay import ReplayBuffer
from shared.obs.metrics import Metrics
from shared.replicas.redis_log import StreamWriter
from shared.replicas.remote_subscription import RemoteSubscription
from shared.replicas.replicated import Replicas
from shared.replicas.store import PRODUCER_LOST_BOUND_S, Claim, IdentityStore
from shared.replicas.store_keys import follow_key, replica_key
from shared.schemas import ChatCompletionRequest, parse_request
from shared.service import Service
from shared.settings import Settings
from shared.streaming import DONE_DATA
from tests.redis_server import RedisServer

from .scripted import ScriptedEngine, settle

pytestmark = pytest.mark.timeout(60)


def chat(**extra: Any) -> ChatCompletionRequest:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "a b"}], "stream": True, "max_tokens": 8}
    return parse_request(ChatCompletionRequest, {**body, **extra})


async def drain(events: AsyncIterator[bytes]) -> bytes:
    return b"".join([chunk async for chunk in events])


def trips(metrics: Metrics, op: str) -> float:
    return metrics.store_round_trips.labels(op)._value.get()


def answered_trips(metrics: Metrics, op: str) -> float:
    """Round trips of `op` that have ended (their latency observed): the caller has the answer."""
    (family,) = metrics.store_latency.collect()
    return sum(s.value for s in family.samples if s.name.endswith("_count") and s.labels["op"] == op)


async def until(predicate: Callable[[], Awaitable[object] | bool], within_s: float, what: str) -> None:
    """Poll on the test's loop until `predicate()` holds; fail naming `what` after `within_s`."""
    deadline = time.monotonic() + within_s
    while True:
        held = predicate()
        if held if isinstance(held, bool) else await held:
            return
        assert time.monotonic() < deadline, f"not within {within_s} s: {what}"
        await asyncio.sleep(0.01)


async def live_store(redis_server: RedisServer, name: str) -> IdentityStore:
    store = IdentityStore(redis_server.url, name, Metrics())
    store.start(on_cancel=lambda _: None)  # the heartbeat: followers see this owner alive
    async with asyncio.timeout(10):  # ... once its first beat is written (a background task)
        while not await store.client.exists(replica_key(name)):
            await asyncio.sleep(0.01)
    return store


# --- the store alone ---------------------------------------------------------------------------------
async def test_exactly_one_of_many_concurrent_claims_wins(redis_server: RedisServer) -> None:
    stores = [IdentityStore(redis_server.url, f"r{i}", Metrics()) for i in range(3)]
    attempts = [stores[i % 3].claim("claim-race", Claim("fp", f"r{i % 3}", True), 60) for i in range(30)]
    results = await asyncio.gather(*attempts)
    winners = [i for i, result in enumerate(results) if result is None]
    assert len(winners) == 1
    owner = f"r{winners[0] % 3}"
    assert all(result == Claim("fp", owner, True) for result in results if result is not None)
    for store in stores:
        await store.aclose()


async def test_many_streams_cost_few_round_trips_and_followers_get_the_owners_bytes(
    redis_server: RedisServer,
) -> None:
    owner = await live_store(redis_server, "owner-batch")
    writer = StreamWriter(owner, max_events=1000, retention_s=60, running_ttl_s=60)
    streams, steps = 200, 10
    local = {f"batch-{i}": ReplayBuffer(1000, numbered=True) for i in range(streams)}
    for step in range(steps + 1):
        for request_id, buffer in local.items():
            data = DONE_DATA if step == steps else orjson.dumps({"token": step, "of": request_id})
            writer.append(request_id, buffer.next_sequence, data)
            buffer.append(data)
        await asyncio.sleep(0)  # one loop turn per "engine step", as vLLM delivers outputs
    for buffer in local.values():
        buffer.close()
    await writer.drain()
    round_trips = trips(owner.metrics, "write")
    assert round_trips <= 2 * (steps + 1)  # one pipeline per step at most, not one per event
    assert owner.metrics.store_commands.labels("write")._value.get() >= streams * (steps + 1)

    follower = IdentityStore(redis_server.url, "follower-batch", Metrics())
    claim = Claim("fp", "owner-batch", True)
    for request_id in ("batch-0", "batch-199"):
        expected = await drain(local[request_id].follow(0))
        remote = RemoteSubscription(follower, request_id, claim, 0, follower.metrics)
        assert await drain(remote.events()) == expected
        resumed = RemoteSubscription(follower, request_id, claim, 4, follower.metrics)
        assert await drain(resumed.events()) == await drain(local[request_id].follow(4))
    await follower.aclose()
    await owner.aclose()


async def test_a_follower_of_an_unnumbered_stream_gets_the_owners_bytes_without_ids(
    redis_server: RedisServer,
) -> None:
    owner = await live_store(redis_server, "owner-plain")
    writer = StreamWriter(owner, max_events=100, retention_s=60, running_ttl_s=60)
    local = ReplayBuffer(100, numbered=False)  # its creator did not ask for text/event-stream
    for data in (b'{"token":1}', b'{"token":2}', DONE_DATA):
        writer.append("plain", local.next_sequence, data)
        local.append(data)
    local.close()
    await writer.drain()
    follower = IdentityStore(redis_server.url, "follower-plain", Metrics())
    claim = Claim("fp", "owner-plain", True, numbered=False)
    remote = RemoteSubscription(follower, "plain", claim, 0, follower.metrics)
    raw = await drain(remote.events())
    assert raw == await drain(local.follow(0))
    assert raw.startswith(b'data: {"token":1}\n\n') and b"id: " not in raw
    await follower.aclose()
    await owner.aclose()


async def test_a_follower_behind_the_trimmed_stream_gets_a_clear_error(redis_server: RedisServer) -> None:
    owner = await live_store(redis_server, "owner-trim")
    writer = StreamWriter(owner, max_events=16, retention_s=60, running_ttl_s=60)
    for sequence in range(1, 201):
        writer.append("trimmed", sequence, b"{}")
        if sequence % 20 == 0:
            await writer.drain()
    await writer.drain()
    view = await owner.view("trimmed", "owner-trim")
    assert view.first is not None and view.first > 1 and view.last == 200
    remote = RemoteSubscription(owner, "trimmed", Claim("fp", "owner-trim", True), 0, owner.metrics)
    raw = await drain(remote.events())
    assert b'"code":"events_gone"' in raw and raw.endswith(b"data: [DONE]\n\n") and b"id: " not in raw
    await owner.aclose()


async def test_a_follower_of_an_owner_without_heartbeat_hears_producer_lost(redis_server: RedisServer) -> None:
    store = IdentityStore(redis_server.url, "reader", Metrics())
    remote = RemoteSubscription(store, "orphan", Claim("fp", "never-beat", True), 0, store.metrics)
    started = time.monotonic()
    raw = await drain(remote.events())
    assert b'"code":"producer_lost"' in raw and raw.endswith(b"data: [DONE]\n\n")
    assert time.monotonic() - started < PRODUCER_LOST_BOUND_S
    await store.aclose()


async def test_the_heartbeat_outlives_an_unexpected_error(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fault the real client cannot be made to raise on demand (a stand-in set() that fails
    once with something neither RedisError nor OSError): the heartbeat logs it, counts it and
    beats again, instead of dying and letting followers declare a live replica dead."""
    store = await live_store(redis_server, "beats-on")
    real_set = store.control.set
    failures = []

    async def set_failing_once(*args: Any, **kwargs: Any) -> Any:
        if not failures:
            failures.append(args)
            raise RuntimeError("an unexpected fault")
        return await real_set(*args, **kwargs)

    await store.client.delete(replica_key("beats-on"))
    monkeypatch.setattr(store.control, "set", set_failing_once)
    await until(lambda: bool(failures), 10, "the failing beat")
    await until(lambda: store.client.exists(replica_key("beats-on")), 10, "the beat after it")
    assert store.metrics.store_errors.labels("heartbeat", "unexpected")._value.get() == 1
    await store.aclose()


async def test_the_heartbeat_comes_back_after_the_store_restarts(redis_server: RedisServer) -> None:
    """A store killed and started again holds nothing: each replica's next beat must write its key
    anew, or followers would declare a live replica dead (and, with takeover, run its generations
    twice). Idle beats, no request to wake the connection up."""
    store = await live_store(redis_server, "beats-after-restart")
    await until(lambda: store.client.exists(replica_key("beats-after-restart")), 10, "the first beat")
    redis_server.stop()
    try:
        failed_beats = store.metrics.store_errors.labels("heartbeat", "unreachable")
        await until(lambda: failed_beats._value.get() >= 1, 20, "a failed beat")
    finally:
        redis_server.start()
    await until(lambda: store.client.exists(replica_key("beats-after-restart")), 15, "a beat after the restart")
    await store.aclose()


async def test_an_end_written_during_a_store_outage_is_written_once_the_store_is_back(
    redis_server: RedisServer,
) -> None:
    """Events flushed while the store is down are dropped (followers see the gap), but the end is
    kept and retried: without it the claim says "running" for its whole TTL."""
    owner = await live_store(redis_server, "owner-outage")
    writer = StreamWriter(owner, max_events=100, retention_s=60, running_ttl_s=60)
    claim = Claim("fp", "owner-outage", True)
    redis_server.stop()
    try:
        writer.append("ends-in-outage", 1, DONE_DATA)
        writer.finish("ends-in-outage", Claim("fp", "owner-outage", True, state="completed"), None)
        failed_writes = owner.metrics.store_errors.labels("write", "unreachable")
        await until(lambda: failed_writes._value.get() >= 1, 20, "a failed flush")
    finally:
        redis_server.start()
    await writer.drain(timeout_s=20)
    assert await owner.get("ends-in-outage") == replace(claim, state="completed")
    await owner.aclose()


async def test_an_end_whose_write_fails_unexpectedly_is_written_on_the_next_flush(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stand-in append that fails once with neither a RedisError nor an OSError (a client fault
    the real one cannot be made to raise on demand): handled like an outage, the end is kept and
    written by the next flush instead of being dropped with the flusher task."""
    owner = await live_store(redis_server, "owner-fault")
    writer = StreamWriter(owner, max_events=100, retention_s=60, running_ttl_s=60)
    real_append = owner.append
    failures: list[object] = []

    async def append_failing_once(batch: Any) -> list[str]:
        if not failures:
            failures.append(batch)
            raise RuntimeError("an unexpected fault")
        return await real_append(batch)

    monkeypatch.setattr(owner, "append", append_failing_once)
    writer.append("ends-after-fault", 1, DONE_DATA)
    writer.finish("ends-after-fault", Claim("fp", "owner-fault", True, state="completed"), None)
    await until(lambda: bool(failures), 10, "the failing flush")
    await writer.drain(timeout_s=20)
    assert await owner.get("ends-after-fault") == Claim("fp", "owner-fault", True, state="completed")
    await owner.aclose()


async def test_a_follower_whose_claim_is_gone_ends_with_a_clear_error(redis_server: RedisServer) -> None:
    """The owner is alive but the claim is gone (expired without its end, or released after a
    refusal): nothing more can come, so the follower says so instead of waiting."""
    owner = await live_store(redis_server, "owner-alive")
    remote = RemoteSubscription(owner, "claim-gone", Claim("fp", "owner-alive", True), 0, owner.metrics)
    raw = await asyncio.wait_for(drain(remote.events()), timeout=10)
    assert b'"code":"events_gone"' in raw and raw.endswith(b"data: [DONE]\n\n")
    await owner.aclose()


async def test_a_follower_of_a_claim_released_after_a_refusal_gets_the_owners_answer(
    redis_server: RedisServer,
) -> None:
    """A duplicate that came to follow an id whose owner then refused it after the claim (429 at
    the in-flight cap) answers the owner's 429, Retry-After included, not 410 events_gone."""
    owner = await live_store(redis_server, "owner-refusing")
    claim = Claim("fp", "owner-refusing", True)
    assert await owner.claim("refused-429", claim, 60) is None
    remote = RemoteSubscription(owner, "refused-429", claim, 0, owner.metrics)
    admitted = asyncio.ensure_future(remote.admitted())
    await until(lambda: answered_trips(owner.metrics, "read") >= 1, 10, "the follower's first read")
    assert not admitted.done()  # the claim stands and its owner lives: it waits
    await owner.release("refused-429", Overloaded("too many requests in flight", retry_after_s=3))
    with pytest.raises(Overloaded) as refused:
        await asyncio.wait_for(admitted, timeout=10)
    assert refused.value.retry_after_s == 3 and refused.value.message == "too many requests in flight"
    await owner.release("released-plain")  # no refusal kept: a claim gone is events_gone, as before
    assert await owner.refusal("released-plain") is None
    await owner.aclose()


# --- two Services sharing the store -------------------------------------------------------------------
def replica(redis_server: RedisServer, engine: ScriptedEngine, **overrides: Any) -> Service:
    return Service(Settings(redis_url=redis_server.url, **overrides), engine)


async def test_one_generation_per_id_across_replicas_with_identical_bytes(redis_server: RedisServer) -> None:
    engine_a, engine_b = ScriptedEngine(auto=True), ScriptedEngine(auto=True)
    a, b = replica(redis_server, engine_a), replica(redis_server, engine_b)
    opened = await asyncio.gather(*(svc.open("chat", chat(), "across") for svc in (a, b, a, b)))
    bodies = await asyncio.gather(*(drain(sub.events()) for sub in opened))
    assert len(set(bodies)) == 1 and bodies[0].endswith(b"data: [DONE]\n\n")
    assert len(engine_a.started) + len(engine_b.started) == 1
    for svc in (a, b):  # after the end: replayed, never regenerated; another body: 422 everywhere
        assert await drain((await svc.open("chat", chat(), "across")).events()) == bodies[0]
        with pytest.raises(IdempotencyConflict):
            await svc.open("chat", chat(max_tokens=9), "across")
    assert len(engine_a.started) + len(engine_b.started) == 1
    await a.aclose()
    await b.aclose()


async def test_a_non_streaming_answer_is_the_same_body_on_the_other_replica(redis_server: RedisServer) -> None:
    a = replica(redis_server, ScriptedEngine())
    b = replica(redis_server, ScriptedEngine())
    owner = await a.open("chat", chat(stream=False), "whole")
    follower = await b.open("chat", chat(stream=False), "whole")
    waiting = asyncio.ensure_future(follower.response())
    await settle()
    a.engine.step(8)  # type: ignore[attr-defined]
    assert await owner.response() == await waiting
    await a.aclose()
    await b.aclose()


async def test_a_request_refused_while_rendering_is_refused_alike_on_the_other_replica(
    redis_server: RedisServer,
) -> None:
    # A long prompt (rendered in the tokenizer thread, so the verdict comes after the claim):
    # within the character bound of 200 tokens, over the token limit.
    a = replica(redis_server, ScriptedEngine(), max_prompt_tokens=200)
    b = replica(redis_server, ScriptedEngine(), max_prompt_tokens=200)
    long_chat = chat(messages=[{"role": "user", "content": "w " * 2500}])
    with pytest.raises(InvalidRequest) as here:
        await (await a.open("chat", long_chat, "refused")).admitted()
    with pytest.raises(StoredError) as there:
        await (await b.open("chat", long_chat, "refused")).admitted()
    assert there.value.status_code == 400 and there.value.to_openai() == here.value.to_openai()
    await a.aclose()
    await b.aclose()


async def test_a_short_prompt_refused_at_once_is_refused_alike_on_the_other_replica(
    redis_server: RedisServer,
) -> None:
    a = replica(redis_server, ScriptedEngine(), max_prompt_tokens=1)  # "a b" renders to 2 tokens
    b = replica(redis_server, ScriptedEngine(), max_prompt_tokens=1)
    with pytest.raises(InvalidRequest) as here:
        await a.open("chat", chat(), "refused-short")  # refused before any claim is kept
    with pytest.raises(InvalidRequest) as there:
        await b.open("chat", chat(), "refused-short")
    assert there.value.to_openai() == here.value.to_openai()
    await a.aclose()
    await b.aclose()


async def test_cancel_sent_to_another_replica_aborts_on_the_owner(redis_server: RedisServer) -> None:
    engine_a = ScriptedEngine()
    a, b = replica(redis_server, engine_a), replica(redis_server, ScriptedEngine())
    owner = await a.open("chat", chat(max_tokens=100), "cancel-far")
    reading = asyncio.ensure_future(drain(owner.events()))
    await settle()
    outcome = await b.cancel("cancel-far")
    assert outcome.status == "cancelled"
    assert len(engine_a.aborted) == 1
    assert b'"code":"request_cancelled"' in await reading
    await a.aclose()
    await b.aclose()


async def test_the_grace_window_counts_readers_on_other_replicas(redis_server: RedisServer) -> None:
    """B's reader is present in the store before A's own reader leaves; when A's window runs out,
    A asks the store (a "grace" round trip), finds it and keeps the generation. Once B's reader
    has left too, its presence lapses (FOLLOW_TTL_S) and the window ends the generation."""
    engine_a = ScriptedEngine()
    a = replica(redis_server, engine_a, disconnect_grace_s=0.2)
    b = replica(redis_server, ScriptedEngine(), disconnect_grace_s=0.2)
    owner = await a.open("chat", chat(max_tokens=100), "grace-far")
    follower = await b.open("chat", chat(max_tokens=100), "grace-far")
    reading = asyncio.ensure_future(drain(follower.events()))
    looker = IdentityStore(redis_server.url, "looker", Metrics())
    await until(lambda: looker.client.exists(follow_key("grace-far")), 10, "B's reader present in the store")
    await looker.aclose()
    owner.close()  # A's reader leaves: its window starts
    await until(lambda: answered_trips(a.metrics, "grace") >= 1, 10, "A's window ran out and asked the store")
    assert engine_a.running and not engine_a.aborted  # B still reads
    reading.cancel()  # B's reader leaves: its presence lapses, then the window runs once more
    await until(lambda: not engine_a.running, 30, "the window ended the generation")
    assert engine_a.aborted and a.metrics.aborted_requests.labels("grace_expired")._value.get() == 1
    await a.aclose()
    await b.aclose()


async def test_store_outage_refuses_ids_serves_anonymous_and_recovers(redis_server: RedisServer) -> None:
    a = replica(redis_server, ScriptedEngine(auto=True))
    redis_server.stop()
    try:
        with pytest.raises(StoreUnavailable):
            await a.open("chat", chat(), "during-outage")
        with pytest.raises(StoreUnavailable):
            await a.cancel("during-outage")
        assert b"[DONE]" in await drain((await a.open("chat", chat())).events())
        assert a.metrics.store_errors.labels("claim", "unreachable")._value.get() >= 1
    finally:
        redis_server.start()
    assert b"[DONE]" in await drain((await a.open("chat", chat(), "after-outage")).events())
    with pytest.raises(EventsGone):  # resume of an id the restarted (empty) store never saw
        await a.open("chat", chat(), "during-outage", last_event_id=3)
    await a.aclose()


async def test_without_takeover_a_request_for_an_id_whose_owner_died_is_refused(
    redis_server: RedisServer,
) -> None:
    b = replica(redis_server, ScriptedEngine(), takeover=False)
    store = IdentityStore(redis_server.url, "x", Metrics())
    fingerprint_owner = replica(redis_server, ScriptedEngine(), takeover=False)
    owner = await fingerprint_owner.open("chat", chat(), "owner-dies")
    # The owner's process "dies": its heartbeat stops and lapses (deleted here to skip the wait).
    replicas = fingerprint_owner._identity  # the store-backed identity BUNDLE_REDIS_URL chose
    assert isinstance(replicas, Replicas)
    # Its beats go to another name from now on; once one has landed there, no beat of the old
    # name is still in flight, and the old one can be deleted for good.
    replicas.store.heartbeat.replica_id = "owner-after-death"
    await until(lambda: store.client.exists(replica_key("owner-after-death")), 10, "a beat under the new name")
    await store.client.delete(replica_key(replicas.replica_id))
    with pytest.raises(ProducerLost):
        await b.open("chat", chat(), "owner-dies")
    owner.close()
    await store.aclose()
    await fingerprint_owner.aclose()
    await b.aclose()
