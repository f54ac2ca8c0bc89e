"""Engine death on a fault-injecting engine (fast, exact). The same on the REAL engine (vLLM's
engine core SIGKILLed under a real server, which must then exit non-zero) is the last test of
tests/test_replicas.py, on a replica whose engine the suite has already paid to start."""

from __future__ import annotations

import httpx
import orjson
import pytest

from shared.http.api import create_app
from shared.server_state import ENGINE_DEAD_EXIT_CODE
from shared.settings import Settings
from tests.fakes import dying_engine

exits: list[int] = []


@pytest.fixture
async def client() -> httpx.AsyncClient:
    exits.clear()
    # No warm-up: it would spend the engine's one life (a warm-up that kills the engine fails
    # the start-up instead, which is right, but not what these tests are about).
    app = create_app(Settings(warm_up=False), engine_factory=dying_engine, request_exit=exits.append)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://bundle") as http:
            yield http


async def test_death_mid_stream_is_one_error_event_then_done_and_health_turns_503(
    client: httpx.AsyncClient,
) -> None:
    assert (await client.get("/health")).status_code == 200
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200  # the stream had started when the engine died
    datas = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert datas[-1] == "[DONE]"
    errors = [d for d in datas[:-1] if "error" in orjson.loads(d)]
    assert len(errors) == 1 and datas[-2] == errors[0]
    error = orjson.loads(errors[0])["error"]
    assert error["code"] == "engine_unavailable" and error["message"]
    texts = [orjson.loads(d)["choices"][0]["delta"].get("content") for d in datas[1:-2]]
    assert texts == ["a", "b", "c"]

    health = await client.get("/health")
    assert health.status_code == 503
    assert health.json()["error"]["code"] == "engine_unavailable"
    # Later requests fail cleanly too, as a non-streaming 503 JSON error.
    again = await client.post("/v1/chat/completions", json={**body, "stream": False})
    assert again.status_code == 503
    assert again.json()["error"]["type"] == "server_error"


async def test_after_death_a_new_stream_gets_503_before_any_200_and_the_server_asks_to_exit(
    client: httpx.AsyncClient,
) -> None:
    import asyncio

    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    await client.post("/v1/chat/completions", json=body)  # dies during this one
    refused = await client.post("/v1/chat/completions", json=body)
    assert refused.status_code == 503  # not a 200 whose only event is an error
    assert refused.headers["content-type"] == "application/json"
    assert refused.json()["error"]["code"] == "engine_unavailable"
    # The watchdog's poll, settle, flush and linger take a few seconds; the bound only ends a hang.
    async with asyncio.timeout(60):
        while not exits:
            await asyncio.sleep(0.05)
    assert exits == [ENGINE_DEAD_EXIT_CODE]
