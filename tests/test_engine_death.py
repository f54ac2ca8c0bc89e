"""Engine death: mid-stream on a fault-injecting engine (fast, exact), then on the REAL engine by
killing vLLM's engine core process under a real server, which must then exit non-zero."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import orjson
import pytest

from shared.api import create_app
from shared.server_state import ENGINE_DEAD_EXIT_CODE
from shared.settings import Settings
from tests.conftest import long_chat
from tests.fakes import dying_engine
from tests.real_server import bundle_server, data_events

# From the kill to the process's exit: the watchdog's poll (0.25 s), the signal settle (0.2 s),
# the error flush (at most 5 s), the 503 linger (2 s), uvicorn's shutdown and the engine's; the
# bound leaves room for a busy 2-core box.
EXIT_BOUND_S = 30.0
exits: list[int] = []


@pytest.fixture
async def client() -> httpx.AsyncClient:
    exits.clear()
    app = create_app(Settings(), engine_factory=dying_engine, request_exit=exits.append)
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
    for _ in range(200):  # the watchdog: poll, settle, flush, linger (a few seconds at most)
        if exits:
            break
        await asyncio.sleep(0.05)
    assert exits == [ENGINE_DEAD_EXIT_CODE]


def test_killing_the_real_engine_core_ends_streams_refuses_new_work_and_exits_non_zero(tmp_path: Path) -> None:
    with bundle_server(tmp_path) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        with client.stream("POST", "/v1/chat/completions", json=long_chat()) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            for _ in range(6):
                next(lines)
            server.engine_core().send_signal(signal.SIGKILL)
            killed = time.monotonic()
            rest = data_events(lines)
        assert rest[-1] == "[DONE]"
        error = orjson.loads(rest[-2])["error"]
        assert error["code"] == "engine_unavailable", error

        refused = client.post("/v1/chat/completions", json=long_chat())
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "engine_unavailable"
        assert client.get("/health").status_code == 503
        assert "bundle_engine_running_requests 0.0" in client.get("/metrics").text

        code = server.wait(timeout=EXIT_BOUND_S)
        took = time.monotonic() - killed
    assert code == ENGINE_DEAD_EXIT_CODE, server.log.read_text()[-3000:]
    print(f"server exited {took:.1f} s after the engine core was killed")
