"""The lifecycle a snapshotting platform drives (start, warm up, sleep, wake) and the engine's
sleep mode. On the real CPU engine sleep and wake are no-ops (vLLM's CPU build has no sleep
mode), which is what these tests check first. What an engine does while it really sleeps can only
be produced with a stand-in for vLLM's AsyncLLM, `SleepyLLM` below, and the tests say so."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import pytest

from shared.engine.contract import Engine, EngineInfo, SamplingRequest
from shared.engine.vllm import VLLMEngine
from shared.errors import EngineUnavailable
from shared.lifecycle import SAMPLER_TRITON_MIN_ROWS, EngineLifecycle, first_token, warm_up
from shared.settings import Settings
from tests.conftest import ENGINE_SETTINGS, LiveServers
from tests.gate import GatedEngine
from tests.scripted import settle


# --- the real CPU engine ------------------------------------------------------------------------
def test_sleep_and_wake_are_safe_no_ops_on_the_cpu_build(live: LiveServers, caplog: Any) -> None:
    engine = live.engine
    real = engine.inner if isinstance(engine, GatedEngine) else engine  # `asleep` is vLLM's engine's own
    with caplog.at_level(logging.INFO, logger="shared.engine.vllm"):
        live.call(engine.sleep())
        assert not real.asleep and engine.ready() and engine.healthy()  # type: ignore[attr-defined]
        live.call(engine.wake_up())
    assert [r.message for r in caplog.records if "sleep mode" in r.message]  # one line each, said
    assert engine.ready()
    assert 0 < live.call(first_token(engine)) < 60


def test_the_lifecycle_on_the_real_engine(live: LiveServers) -> None:
    opened: list[Settings] = []

    @asynccontextmanager
    async def borrow(settings: Settings) -> AsyncIterator[Engine]:
        opened.append(settings)  # the session's engine stands in for a fresh start (one per suite)
        yield live.engine

    lifecycle = EngineLifecycle(ENGINE_SETTINGS, opener=borrow)
    live.call(lifecycle.prepare_for_snapshot())  # start, warm up (a 64-stream wave), sleep
    assert opened[0].sleep_mode is True  # sleep mode is chosen at start
    assert live.engine.running_requests() == 0  # the warm-up left nothing behind
    report = live.call(lifecycle.wake())
    assert 0 < report.first_token_s < 60 and report.wake_up_s >= 0

    async def through_factory() -> Engine:
        async with lifecycle.engine_factory(ENGINE_SETTINGS) as engine:
            return engine

    assert live.call(through_factory()) is live.engine  # the app's lifespan gets this engine
    live.call(lifecycle.stop())
    assert lifecycle.engine is None and live.engine.healthy()  # stop closed only what it opened


def test_warm_up_runs_each_top_k_top_p_sampler_path_with_enough_rows(
    live: LiveServers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's GPU sampler compiles a Triton kernel per (top-k on, top-p on) pair the first time a
    step samples >= 8 such rows (~7 s on the H200, inside the first burst of Cog predictions).
    The warm-up must put that many of each pair in the real engine at once. Counted at the
    engine's door, on the real CPU engine (which itself has no Triton: the compile is GPU-only)."""
    engine = live.engine
    plain = engine.generate
    in_flight: Counter[tuple[bool, bool]] = Counter()
    peak: Counter[tuple[bool, bool]] = Counter()

    async def counting(request_id: str, request: SamplingRequest) -> AsyncIterator[Any]:
        sampled = request.temperature > 0
        pair = (sampled and bool(request.top_k), sampled and request.top_p < 1)
        in_flight[pair] += 1
        peak[pair] = max(peak[pair], in_flight[pair])
        try:
            async for delta in plain(request_id, request):
                yield delta
        finally:
            in_flight[pair] -= 1

    monkeypatch.setattr(engine, "generate", counting)
    live.call(warm_up(engine, ENGINE_SETTINGS))
    for pair in ((True, True), (True, False), (False, True)):
        assert peak[pair] >= SAMPLER_TRITON_MIN_ROWS, (pair, dict(peak))
    assert live.engine.running_requests() == 0


# --- a stand-in AsyncLLM that really sleeps -----------------------------------------------------
class SleepyLLM:
    """Just enough of AsyncLLM for VLLMEngine, with sleep mode on and a wake-up that can fail."""

    def __init__(self, wake_error: Exception | None = None, wake_s: float = 0.0) -> None:
        self.model_config = SimpleNamespace(enable_sleep_mode=True)
        self.errored = False
        self.sleeping = False
        self.wake_error = wake_error
        self.wake_s = wake_s
        self.generated = 0

    def get_tokenizer(self) -> Any:
        return None

    async def sleep(self, level: int = 1) -> None:
        self.sleeping = True

    async def wake_up(self) -> None:
        await asyncio.sleep(self.wake_s)
        if self.wake_error is not None:
            raise self.wake_error
        self.sleeping = False

    async def generate(
        self, prompt: Any, params: Any, request_id: str, lora_request: Any = None
    ) -> AsyncIterator[Any]:
        assert not self.sleeping, "a request reached a sleeping engine"
        self.generated += 1
        completion = SimpleNamespace(text="x", token_ids=[7], finish_reason="length", index=0)
        yield SimpleNamespace(outputs=[completion], finished=True, num_cached_tokens=0)


def sleepy_engine(llm: SleepyLLM, wake_wait_s: float = 5.0) -> VLLMEngine:
    return VLLMEngine(llm, EngineInfo("tiny", 256, vocab_size=100), wake_wait_s=wake_wait_s)


async def collect(engine: Engine) -> list[str]:
    request = SamplingRequest(prompt_token_ids=[1, 2], max_tokens=1)
    return [delta.text async for delta in engine.generate("r", request)]


def test_a_request_while_asleep_waits_for_the_wake_up() -> None:
    async def scenario() -> None:
        llm = SleepyLLM()
        engine = sleepy_engine(llm)
        await engine.sleep()
        assert engine.asleep and not engine.ready() and engine.healthy()  # 503 on /health, alive
        waiting = asyncio.create_task(collect(engine))
        await settle()  # it runs as far as it can: to its wait for the wake-up (no clock involved)
        assert not waiting.done() and llm.generated == 0
        await engine.wake_up()
        assert await asyncio.wait_for(waiting, 5) == ["x"]
        assert engine.ready()

    asyncio.run(scenario())


def test_a_request_while_asleep_fails_with_503_after_the_bound() -> None:
    async def scenario() -> None:
        engine = sleepy_engine(SleepyLLM(), wake_wait_s=0.1)
        await engine.sleep()
        with pytest.raises(EngineUnavailable, match="asleep") as caught:
            await collect(engine)
        assert caught.value.status_code == 503

    asyncio.run(scenario())


def lifecycle_on(engine: Engine, **overrides: Any) -> EngineLifecycle:
    @asynccontextmanager
    async def opener(settings: Settings) -> AsyncIterator[Engine]:
        yield engine

    return EngineLifecycle(Settings(max_num_seqs=4, **overrides), opener=opener)


def test_a_failed_wake_up_raises_so_the_container_ends() -> None:
    async def scenario() -> None:
        lifecycle = lifecycle_on(sleepy_engine(SleepyLLM(wake_error=RuntimeError("CUDA error: no device"))))
        await lifecycle.prepare_for_snapshot()
        with pytest.raises(EngineUnavailable, match="did not wake up: RuntimeError: CUDA error"):
            await lifecycle.wake()

    asyncio.run(scenario())


def test_a_slow_wake_up_is_logged_with_its_phases(caplog: Any) -> None:
    async def scenario() -> None:
        lifecycle = lifecycle_on(sleepy_engine(SleepyLLM(wake_s=0.05)), wake_slow_s=0.01)
        await lifecycle.start()
        await warm_up(lifecycle._engine(), lifecycle.settings)
        await lifecycle.sleep()
        report = await lifecycle.wake()
        assert report.wake_up_s >= 0.05

    with caplog.at_level(logging.INFO, logger="shared.lifecycle"):
        asyncio.run(scenario())
    slow = [r for r in caplog.records if r.levelno == logging.WARNING and "slow wake-up" in r.message]
    assert slow and "wake_up" in slow[0].message and "first token" in slow[0].message


# --- through the API: /health and a request while the engine sleeps ------------------------------
def test_the_api_answers_503_on_health_while_asleep_and_a_request_waits_for_the_wake_up() -> None:
    from fastapi.testclient import TestClient

    from shared.http.api import create_app

    llm = SleepyLLM()
    engine = sleepy_engine(llm)
    app = create_app(Settings(model="tiny", max_num_seqs=4), engine=engine)
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 1}

    async def wake_once_it_waits() -> None:
        # The request is in: admitted, and its generation waiting for the wake-up, not served.
        service = app.state.service
        while service.stats()["running_generations"] == 0:  # noqa: ASYNC110  (another task's state)
            await asyncio.sleep(0.01)
        await settle()
        assert llm.generated == 0
        await engine.wake_up()

    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        client.portal.call(engine.sleep)
        asleep = client.get("/health")
        assert asleep.status_code == 503 and "asleep" in asleep.json()["error"]["message"]
        woken = client.portal.start_task_soon(wake_once_it_waits)
        answer = client.post("/v1/completions", json=body)  # arrives asleep, served once awake
        woken.result(timeout=60)  # its checks passed
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == "x" and llm.generated == 1
        assert client.get("/health").status_code == 200
