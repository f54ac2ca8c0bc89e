"""Takeover's coordination against a real Redis-protocol server (tests/redis_server.py), in one
process: `Service`s ("replicas") on scripted engines (tests/scripted.py), whose tokens the test
releases one by one, so every step is deterministic. What is checked here is the store's part:
one winner, fencing, hand-off, the event ids. The real engine, real processes and SIGKILL are in
tests/test_takeover.py.

A replica "dies" here by losing its heartbeat (its lease) while its generation is still running
in this process: exactly a replica paused past its lease. When it resumes, its writes are fenced
out and it stops without emitting more."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from shared.engine.contract import EngineDelta, SamplingRequest
from shared.errors import EngineUnavailable
from shared.replicas.replicated import Replicas
from shared.replicas.store import Claim
from shared.replicas.store_keys import replica_key
from shared.schemas import ChatCompletionRequest, parse_request
from shared.server_state import GuardedEngine, ServerState
from shared.service import Service
from shared.settings import Settings
from tests.redis_server import RedisServer
from tests.scripted import ScriptedEngine, settle
from tests.test_api import sse_events

pytestmark = pytest.mark.timeout(60)


def chat(**extra: Any) -> ChatCompletionRequest:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "a b"}],
        "stream": True,
        "max_tokens": 12,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    return parse_request(ChatCompletionRequest, {**body, **extra})


def replica(redis_server: RedisServer, engine: ScriptedEngine, **overrides: Any) -> Service:
    return Service(Settings(redis_url=redis_server.url, disconnect_grace_s=5, **overrides), engine)


def identity(service: Service) -> Replicas:
    found = service._identity
    assert isinstance(found, Replicas)
    return found


async def lose_lease(service: Service) -> None:
    """The replica's heartbeat stops and lapses (deleted, to skip the wait); it runs on."""
    replicas = identity(service)
    replicas.store._tasks[1].cancel()  # deaf to cancels sent to it from now on
    # Its beats go to another name; once one has landed there, no beat of the old name is still
    # in flight (a cancelled one could land after the delete), so the old one stays deleted.
    lapsed = f"{replicas.replica_id}-lapsed"
    replicas.store.heartbeat.replica_id = lapsed
    async with asyncio.timeout(10):
        while not await replicas.store.client.exists(replica_key(lapsed)):
            await asyncio.sleep(0.01)
    await replicas.store.client.delete(replica_key(replicas.replica_id))


async def read(events: AsyncIterator[bytes], count: int | None = None) -> bytes:
    """Read `count` events (all when None)."""
    raw = b""
    async for chunk in events:
        raw += chunk
        if count is not None and raw.count(b"\n\n") >= count:
            break
    return raw


def content(raw: bytes) -> str:
    text = ""
    for _, data in sse_events(raw):
        if data != b"[DONE]":
            chunk = orjson.loads(data)
            for choice in chunk.get("choices") or ():
                text += (choice.get("delta") or {}).get("content") or ""
    return text


def usage(raw: bytes) -> dict[str, int]:
    for _, data in sse_events(raw):
        if data != b"[DONE]" and (found := orjson.loads(data).get("usage")):
            return dict(found)
    raise AssertionError("no usage chunk")


async def stored_ids(service: Service, request_id: str) -> list[int]:
    entries, _ = await identity(service).store.log(request_id)
    return [sequence for sequence, _ in entries]


async def test_a_generation_whose_owner_lost_its_lease_is_continued_by_a_resume_elsewhere(
    redis_server: RedisServer,
) -> None:
    engine_a, engine_b = ScriptedEngine(), ScriptedEngine(auto=True)
    a, b = replica(redis_server, engine_a), replica(redis_server, engine_b)
    reference = await read((await b.open("chat", chat(), "reference", event_ids=True)).events())
    owner = await a.open("chat", chat(), "lease", event_ids=True)
    reading = owner.events()
    await settle()
    engine_a.step(4)
    head = await read(reading, 5)  # the role, then 4 tokens
    await lose_lease(a)
    tail = await read((await b.open("chat", chat(), "lease", last_event_id=5, event_ids=True)).events())
    whole = head + tail
    assert [event_id for event_id, _ in sse_events(whole)] == list(range(1, len(sse_events(whole)) + 1))
    assert content(whole) == content(reference) and usage(whole) == usage(reference)
    assert b.metrics.takeovers.labels("continued")._value.get() == 1
    # A comes back: its next tokens are fenced out and it stops; its reader goes on from the
    # shared log (B's tokens), so its client gets the same whole stream as everyone else.
    engine_a.step(3)
    rest = await asyncio.wait_for(read(reading), 10)
    assert head + rest == whole and not engine_a.running
    assert a.metrics.claims_lost._value.get() == 1
    assert await stored_ids(b, "lease") == list(range(1, len(sse_events(whole)) + 1))
    await a.aclose()
    await b.aclose()


async def test_of_two_replicas_resuming_at_once_exactly_one_continues(redis_server: RedisServer) -> None:
    engine_a = ScriptedEngine()
    engines = [ScriptedEngine(auto=True), ScriptedEngine(auto=True)]
    a = replica(redis_server, engine_a)
    b, c = (replica(redis_server, engine) for engine in engines)
    owner = await a.open("chat", chat(), "race", event_ids=True)
    reading = owner.events()
    await settle()
    engine_a.step(3)
    head = await read(reading, 4)
    await lose_lease(a)
    readers = await asyncio.gather(
        *(svc.open("chat", chat(), "race", last_event_id=4, event_ids=True) for svc in (b, c, b, c))
    )
    tails = await asyncio.gather(*(read(reader.events()) for reader in readers))
    assert len(set(tails)) == 1 and tails[0].endswith(b"data: [DONE]\n\n")
    assert len(engines[0].started) + len(engines[1].started) == 1
    continued = sum(svc.metrics.takeovers.labels("continued")._value.get() for svc in (b, c))
    assert continued == 1
    assert content(head + tails[0]) == " ".join(f"t{i}" for i in range(12)) + " "
    for svc in (a, b, c):
        await svc.aclose()


async def test_a_takeover_of_a_takeover_goes_on_from_the_second_producer(redis_server: RedisServer) -> None:
    engine_a, engine_b, engine_c = ScriptedEngine(), ScriptedEngine(), ScriptedEngine(auto=True)
    a, b, c = (replica(redis_server, engine) for engine in (engine_a, engine_b, engine_c))
    first = (await a.open("chat", chat(), "twice", event_ids=True)).events()
    await settle()
    engine_a.step(3)
    head = await read(first, 4)
    await lose_lease(a)
    second = (await b.open("chat", chat(), "twice", last_event_id=4, event_ids=True)).events()
    await settle()
    engine_b.step(6)  # B generates again what A sent (checked, not sent twice), then 3 more
    middle = await read(second, 3)
    await lose_lease(b)
    tail = await read((await c.open("chat", chat(), "twice", last_event_id=7, event_ids=True)).events())
    whole = head + middle + tail
    assert [event_id for event_id, _ in sse_events(whole)] == list(range(1, len(sse_events(whole)) + 1))
    assert content(whole) == " ".join(f"t{i}" for i in range(12)) + " "
    assert usage(whole)["completion_tokens"] == 12
    claim = await identity(c).store.get("twice")
    assert claim is not None and claim.epoch == 2 and claim.state == "completed"
    for svc in (a, b, c):
        await svc.aclose()


async def test_a_replica_shutting_down_hands_its_streams_over(redis_server: RedisServer) -> None:
    engine_a = ScriptedEngine()
    a, b = replica(redis_server, engine_a), replica(redis_server, ScriptedEngine(auto=True))
    owner = await a.open("chat", chat(), "handed", event_ids=True)
    reading = owner.events()
    await settle()
    engine_a.step(5)
    head = await read(reading, 6)
    await a.end_running()  # the drain's deadline
    assert await read(reading) == b""  # cut without [DONE]: the client resumes elsewhere
    claim = await identity(b).store.get("handed")
    assert claim is not None and claim.owner == "" and claim.running
    tail = await read((await b.open("chat", chat(), "handed", last_event_id=6, event_ids=True)).events())
    assert content(head + tail) == " ".join(f"t{i}" for i in range(12)) + " "
    assert a.metrics.handoffs._value.get() == 1
    await a.aclose()
    await b.aclose()


@pytest.mark.parametrize("extra", [{"n": 2}, {"logprobs": True, "top_logprobs": 1}])
async def test_what_cannot_be_continued_exactly_ends_with_producer_lost(
    redis_server: RedisServer, extra: dict[str, Any]
) -> None:
    engine_a = ScriptedEngine()
    a, b = replica(redis_server, engine_a), replica(redis_server, ScriptedEngine(auto=True))
    request_id = "refused-" + "-".join(extra)
    reading = (await a.open("chat", chat(**extra), request_id, event_ids=True)).events()
    await settle()
    engine_a.step(2)
    head = await read(reading, 3)
    await lose_lease(a)
    resumed = await b.open("chat", chat(**extra), request_id, last_event_id=3, event_ids=True)
    tail = await read(resumed.events())
    assert b'"code":"producer_lost"' in tail and tail.endswith(b"data: [DONE]\n\n")
    assert b.metrics.takeovers.labels("ended")._value.get() == 1 and not b.engine.started  # type: ignore[attr-defined]
    claim = await identity(b).store.get(request_id)
    assert claim == Claim(claim.fingerprint, identity(b).replica_id, True, "failed", True, 1)  # type: ignore[union-attr]
    del head
    await a.aclose()
    await b.aclose()


class StoppingEngine(ScriptedEngine):
    """Stops after `stop_after` tokens the way vLLM's engine does when its core got the SIGTERM
    sent to the whole process group: EngineUnavailable in the middle of the stream."""

    def __init__(self, stop_after: int) -> None:
        super().__init__(auto=True)
        self.stop_after = stop_after

    async def generate(self, request_id: str, request: SamplingRequest) -> AsyncIterator[EngineDelta]:
        produced = 0
        async for delta in super().generate(request_id, request):
            if produced == self.stop_after:
                raise EngineUnavailable("the engine died during generation")
            produced += 1
            yield delta


async def test_an_engine_stopped_by_the_groups_sigterm_hands_its_streams_over(
    redis_server: RedisServer,
) -> None:
    lifecycle = ServerState(shutdown_grace_s=30)
    a = Service(Settings(redis_url=redis_server.url), GuardedEngine(StoppingEngine(stop_after=5), lifecycle))
    b = replica(redis_server, ScriptedEngine(auto=True))
    lifecycle.state = ServerState.DRAINING  # the signal reached the server as well
    head = await read((await a.open("chat", chat(), "group-sigterm", event_ids=True)).events())
    assert b"[DONE]" not in head and b'"error"' not in head  # cut, not ended: it is handed over
    await settle()  # the generation's task ends right after its stream: then its hand-over is queued
    await identity(a).writer.drain()
    claim = await identity(b).store.get("group-sigterm")
    assert claim is not None and claim.owner == "" and claim.running
    resumed = await b.open("chat", chat(), "group-sigterm", last_event_id=len(sse_events(head)), event_ids=True)
    whole = head + await read(resumed.events())
    assert content(whole) == " ".join(f"t{i}" for i in range(12)) + " "
    await a.aclose()
    await b.aclose()
