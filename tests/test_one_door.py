"""One assembly, one door (issue 29): the HTTP app and the Cog runner's bridge are assembled the
same way (`shared.assembly.start_service`) and open generations through the same `Service.open`,
so with BUNDLE_REDIS_URL a Cog prediction and an HTTP request with one request id follow ONE
generation, whichever arrives first.

Real parts: the session's vLLM CPU engine, a real valkey server (tests/redis_server.py), the
HTTP app under uvicorn, the Cog bridge's own functions as the runner calls them (its slot-thread
generator read in this thread), and real `python -m shared.serve` processes for the warm-up.
The generation the second door must find running is held in the engine (tests/gate.py) until
that door has joined it.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import cog_bridge as bridge
import cog_inputs
import httpx
import pytest

from shared import lifecycle as engine_lifecycle
from shared.assembly import start_service
from shared.engine.contract import Engine
from shared.generation.subscription import Subscription
from shared.lifecycle import EngineLifecycle
from shared.schemas import ChatCompletionRequest
from shared.service import Service
from shared.settings import Settings
from tests.conftest import ENGINE_SETTINGS, LiveServers, wait_until
from tests.gate import Gate, Hold
from tests.real_server import bundle_server
from tests.redis_server import RedisServer

pytestmark = pytest.mark.timeout(600)

# The answer's exact length (min_tokens holds it there), so the token counts can be compared.
TOKENS = 64


def _counter(service: Service, name: str) -> float:
    found = re.search(rb"^%s ([0-9.e+]+)$" % name.encode(), service.metrics.exposition(), re.M)
    assert found is not None, name
    return float(found.group(1))


def generations(service: Service) -> float:
    """Generations this service started on the engine, from its own /metrics exposition."""
    return _counter(service, "bundle_engine_generations_total")


def joined(service: Service) -> float:
    """Requests this service served from an existing generation, here or on another replica."""
    return _counter(service, "bundle_attached_requests_total")


@contextlib.contextmanager
def cog_replica(live: LiveServers, redis_url: str) -> Iterator[Service]:
    """A second replica as the Cog runner's setup() assembles it, on the session's engine (the
    runner's own setup opens a fresh engine; two on this machine are too heavy)."""
    settings = Settings(**{**ENGINE_SETTINGS.model_dump(), "redis_url": redis_url})
    stack = contextlib.AsyncExitStack()
    service = live.call(stack.enter_async_context(start_service(settings, engine=live.engine)))
    try:
        yield service
    finally:
        live.call(stack.aclose())


def cog_body(service: Service, held: Hold, seed: int) -> ChatCompletionRequest:
    """The request a prediction stands for, held by `held`: sampled (Cog's defaults: top_k 50,
    top_p 0.9), so a second generation would almost surely write another text."""
    prompt = held.prompt("one door")
    return cog_inputs.chat_request_from_inputs(
        service.settings, prompt=prompt, max_tokens=TOKENS, min_tokens=TOKENS, seed=seed
    )


def http_json(body: ChatCompletionRequest) -> dict[str, Any]:
    """The same body as an HTTP client sends it."""
    return body.model_dump(mode="json", exclude_unset=True, by_alias=True)


def read_prediction(live: LiveServers, subscription: Subscription) -> tuple[str, Any]:
    """A prediction's text read in this (slot) thread, as `Runner.run` does after admitting it
    on the engine's loop (`bridge.start_generation`); and the token counts it reports."""
    text = "".join(bridge.stream_text(subscription, live.loop, RuntimeError))
    return text, bridge.token_counts(subscription)


def post_in_background(url: str, body: dict[str, Any], request_id: str) -> tuple[threading.Thread, list[Any]]:
    answers: list[Any] = []

    def post() -> None:
        headers = {"X-Request-Id": request_id}
        answers.append(httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=300))

    thread = threading.Thread(target=post)
    thread.start()
    return thread, answers


def answered(thread: threading.Thread, answers: list[Any]) -> dict[str, Any]:
    thread.join(300)
    assert answers and answers[0].status_code == 200, answers and answers[0].text
    return dict(answers[0].json())


def test_a_cog_prediction_and_an_http_request_with_one_id_follow_one_generation(
    live: LiveServers, redis_server: RedisServer, gate: Gate
) -> None:
    url, http_service = live.serve(redis_url=redis_server.url)
    with cog_replica(live, redis_server.url) as cog_service:
        before = generations(http_service) + generations(cog_service)

        # HTTP first: the prediction on the other replica joins the generation while it is held
        # in the engine (running, whatever the engine's speed), then reads it to the end.
        with gate.hold(after=1) as held:
            body = cog_body(cog_service, held, seed=1)
            thread, answers = post_in_background(url, http_json(body), "door-http-first")
            held.wait_held()
            joined_before = joined(cog_service)
            subscription = live.call(bridge.start_generation(cog_service, body, "door-http-first"))
            assert joined(cog_service) == joined_before + 1 and held.held_count() == 1
        text, counts = read_prediction(live, subscription)
        answer = answered(thread, answers)
        assert text == answer["choices"][0]["message"]["content"] and text
        usage = answer["usage"]
        assert counts == {"input_token_count": usage["prompt_tokens"], "output_token_count": TOKENS}
        assert generations(http_service) + generations(cog_service) == before + 1
        assert generations(cog_service) == 0  # it followed; the engine ran the HTTP side's one

        # The prediction first: the HTTP request on the other replica joins its generation, held
        # until the HTTP side has joined it.
        with gate.hold(after=1) as held:
            body = cog_body(cog_service, held, seed=2)
            subscription = live.call(bridge.start_generation(cog_service, body, "door-cog-first"))
            held.wait_held()
            joined_before = joined(http_service)
            thread, answers = post_in_background(url, http_json(body), "door-cog-first")
            wait_until(lambda: joined(http_service) == joined_before + 1, timeout=120)
            assert held.held_count() == 1  # one generation: the HTTP request started none
        text, _ = read_prediction(live, subscription)
        answer = answered(thread, answers)
        assert text == answer["choices"][0]["message"]["content"] and text
        assert generations(http_service) + generations(cog_service) == before + 2
        assert generations(cog_service) == 1
        assert http_service.running_requests() == 0  # nothing left on the engine


def test_the_snapshot_path_warms_its_engine_once(live: LiveServers, monkeypatch: pytest.MonkeyPatch) -> None:
    """Modal's pre-snapshot hook warms the engine; the service assembled on it after the restore
    (the app's lifespan through `EngineLifecycle.engine_factory`) must not warm it again."""
    runs: list[Engine] = []
    real_warm_up = engine_lifecycle.warm_up

    async def counted(engine: Engine, settings: Settings) -> None:
        runs.append(engine)
        await real_warm_up(engine, settings)

    monkeypatch.setattr(engine_lifecycle, "warm_up", counted)

    @asynccontextmanager
    async def borrow(settings: Settings) -> AsyncIterator[Engine]:
        yield live.engine  # the session's engine stands in for a fresh start

    lifecycle = EngineLifecycle(ENGINE_SETTINGS, opener=borrow)
    live.call(lifecycle.prepare_for_snapshot())
    before_restore = len(runs)  # 1, or 0 if another test warmed the session's engine already

    async def assemble() -> int:
        async with start_service(ENGINE_SETTINGS, engine_factory=lifecycle.engine_factory) as service:
            return service.stats()["running_generations"]

    assert live.call(assemble()) == 0
    assert len(runs) == before_restore <= 1
    live.call(lifecycle.stop())


def _log_lines(log: Path) -> list[str]:
    return log.read_text(errors="replace").splitlines()


def test_the_http_server_warms_up_before_it_says_ready(tmp_path: Path) -> None:
    """`python -m shared.serve` as deployed: the warm-up ran (its log line) before /health
    answered 200 and before uvicorn said the application had started."""
    with bundle_server(tmp_path, log_level="info") as server:
        lines = _log_lines(server.log)
    warmed = [i for i, line in enumerate(lines) if "warm-up done in" in line]
    started = [i for i, line in enumerate(lines) if "Application startup complete" in line]
    assert len(warmed) == 1, "\n".join(lines[-40:])
    assert not started or warmed[0] < started[0]


def test_bundle_warm_up_0_skips_the_warm_up(tmp_path: Path) -> None:
    with bundle_server(tmp_path, log_level="info", warm_up="0") as server:
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        lines = _log_lines(server.log)
    assert any("warm-up skipped (BUNDLE_WARM_UP=0)" in line for line in lines), "\n".join(lines[-40:])
    assert not any("warm-up done in" in line for line in lines)


def test_no_wrapper_reaches_past_the_door() -> None:
    """The HTTP routes, the Cog runner and bridge, and the Modal app use `Service`'s own methods
    only: none reads its registry, identity or engine (issue 29). The metrics are a sink the HTTP
    layer records its own facts into (admission time, refusals, write fallbacks) through their
    methods, never by reading a value back (`._value`)."""
    root = Path(__file__).resolve().parents[1]
    wrappers = [
        root / "shared" / "http" / "api.py",
        root / "shared" / "server_state.py",
        root / "cog" / "cog_bridge.py",
        *(root / "cog").glob("*.py"),
        *(root / "modal_app").glob("*.py"),
    ]
    # An attribute of an object, not a module named in prose (`shared.engine.vllm`).
    window = re.compile(r"(?<!shared)\.(registry|replicas|_identity|engine)\b|\._value\b")
    found = [
        f"{path.name}:{number}: {line.strip()}"
        for path in wrappers
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if window.search(line) and not line.lstrip().startswith(("from ", "import "))
    ]
    assert found == []

