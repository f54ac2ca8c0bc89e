"""The test gate (tests/gate.py) on the session's real engine: a held generation stays running
until the test releases it, others pass meanwhile, and a frozen engine keeps the request itself."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson
import pytest

from shared.service import Service
from tests.conftest import LiveServers, long_chat
from tests.gate import Gate, Hold
from tests.test_api import sse_events

CHAT = "/v1/chat/completions"


def held_chat(held: Hold, max_tokens: int, **extra: Any) -> dict[str, Any]:
    """A greedy fixed-length stream whose prompt names the hold, with its usage at the end."""
    messages = [{"role": "user", "content": held.prompt("tell me a long story")}]
    return long_chat(
        messages=messages,
        max_tokens=max_tokens,
        temperature=0.0,
        stream_options={"include_usage": True},
        **extra,
    )


def ending(raw: bytes) -> tuple[str | None, int]:
    """The finish reason and the completion tokens of a raw chat stream."""
    chunks = [orjson.loads(data) for _, data in sse_events(raw) if data != b"[DONE]"]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    return next((r for r in reasons if r), None), chunks[-1]["usage"]["completion_tokens"]


async def test_a_held_generation_runs_until_released_while_others_pass(
    base_url: str, service: Service, gate: Gate
) -> None:
    with gate.hold(after=3) as held:
        async with (
            httpx.AsyncClient(base_url=base_url, timeout=60) as client,
            client.stream("POST", CHAT, json=held_chat(held, 300)) as stream,
        ):
            await held.until_held()
            other = await client.post(CHAT, json=long_chat(max_tokens=20, stream=False))
            assert other.json()["usage"]["completion_tokens"] == 20  # not held: another prompt
            assert service.stats()["running_generations"] == 1  # the held one, and only it
            held.release()
            raw = await stream.aread()
    assert raw.endswith(b"data: [DONE]\n\n")
    assert ending(raw) == ("length", 300)  # nothing lost to the hold


async def test_held_from_the_start_the_engine_has_not_seen_it(
    base_url: str, service: Service, gate: Gate
) -> None:
    with gate.hold(after=0) as held:
        async with (
            httpx.AsyncClient(base_url=base_url, timeout=60) as client,
            client.stream("POST", CHAT, json=held_chat(held, 40)) as stream,
        ):
            await held.until_held()
            assert service.stats()["running_generations"] == 1
            assert service.engine.running_requests() == 0
            held.release()
            raw = await stream.aread()
    assert ending(raw) == ("length", 40)


async def test_a_frozen_engine_keeps_the_request_until_released(
    live: LiveServers, base_url: str, service: Service, gate: Gate
) -> None:
    with gate.hold(after=2, freeze_engine=True) as held:
        async with (
            httpx.AsyncClient(base_url=base_url, timeout=60) as client,
            client.stream("POST", CHAT, json=held_chat(held, 1000)) as stream,
        ):
            await held.until_held()
            assert live.call(live.engine.llm.is_paused())  # type: ignore[attr-defined]
            assert service.engine.running_requests() == 1  # in vLLM itself, paused mid-generation
            held.release()
            raw = await stream.aread()
    assert ending(raw) == ("length", 1000)
    assert not live.call(live.engine.llm.is_paused())  # type: ignore[attr-defined]


async def test_cancelling_a_frozen_request_aborts_it_in_the_engine_and_resumes_it(
    base_url: str, service: Service, gate: Gate
) -> None:
    headers = {"X-Request-Id": "gate-frozen-cancel"}
    with gate.hold(after=2, freeze_engine=True) as held:
        async with (
            httpx.AsyncClient(base_url=base_url, timeout=60) as client,
            client.stream("POST", CHAT, json=held_chat(held, 1000), headers=headers) as stream,
        ):
            await held.until_held()
            cancelled = await client.post("/v1/requests/gate-frozen-cancel/cancel")
            raw = await stream.aread()
            assert cancelled.json()["status"] == "cancelled"
            assert b'"code":"request_cancelled"' in raw
            # Aborted in vLLM, though paused: its count drops once the abort has gone through
            # vLLM's output processor (a loop turn or more later on a loaded box).
            async with asyncio.timeout(30):
                while service.engine.running_requests() != 0:
                    await asyncio.sleep(0.01)
            # The engine runs again (the cancelled hold resumed it): a new request completes.
            after = await client.post(CHAT, json=long_chat(max_tokens=10, stream=False))
            assert after.json()["usage"]["completion_tokens"] == 10


async def test_a_generation_that_ends_before_its_hold_fails_the_wait_at_once(base_url: str, gate: Gate) -> None:
    with gate.hold(after=50) as held:
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
            done = await client.post(CHAT, json=held_chat(held, 5))
        assert ending(done.content) == ("length", 5)
        with pytest.raises(AssertionError, match="ended before its hold"):
            await held.until_held()
