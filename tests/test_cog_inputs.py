"""The Cog runner's inputs at parity with Replicate's LLM models, and what it says after engine death.

Unit tests of the bridge first (no server), then the real Cog server (coglet 0.23.1) with the
real CPU engine and the tiny model, where the behaviour crosses the runner: stop sequences that
keep their whitespace, `prompt_template` sent as a raw prompt, `min_tokens` holding a stop off,
`max_tokens` shrinking to the context, errors naming Cog inputs, the token-count metrics, and
(last, it kills the engine) the metrics and failures after the engine died.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cog_bridge as bridge
import cog_inputs
import httpx
import pytest

from shared.engine.vllm_startup import resolve_model_path
from shared.errors import EngineUnavailable, IdempotencyConflict, InvalidRequest
from shared.schemas import ChatCompletionRequest, CompletionRequest
from shared.service import Service
from shared.settings import Settings

from .cog_server import HOLD_RUNNER_REF, engine_killed_under_a_prediction, until
from .scripted import ScriptedEngine
from .test_cog import LONG, CogServer, _health_status, running_cog_server

MAX_MODEL_LEN = 1024  # small, so a prompt that leaves less than the default 512 is cheap to send


# --- the bridge, no server ----------------------------------------------------------------------
def test_stop_sequences_keep_whitespace_and_take_a_json_list() -> None:
    split = cog_inputs.split_stop_sequences
    assert split("\n") == ["\n"]
    assert split(" User:") == [" User:"]
    assert split("END, STOP") == ["END", " STOP"]
    assert split('["a,b", "\\n", " User:"]') == ["a,b", "\n", " User:"]  # commas and escapes
    assert split("[INST]") == ["[INST]"]  # not JSON: one stop, as before
    assert split("[1, 2]") == ["[1", " 2]"]  # JSON, but not strings: text
    assert split("") is None and split(",,") is None and split("[]") is None


def test_prompt_template_is_a_raw_completion_prompt() -> None:
    settings = Settings()
    body = cog_inputs.request_from_inputs(
        settings,
        prompt="hi",
        system_prompt="be brief",
        prompt_template='<s>{system_prompt} [INST] {prompt} [/INST] {"json": 1}',
    )
    assert isinstance(body, CompletionRequest)
    assert body.prompt == '<s>be brief [INST] hi [/INST] {"json": 1}'  # other braces stay
    assert isinstance(cog_inputs.request_from_inputs(settings, prompt="hi"), ChatCompletionRequest)
    with pytest.raises(InvalidRequest, match=r"prompt_template must contain \{prompt\}") as caught:
        cog_inputs.request_from_inputs(settings, prompt="hi", prompt_template="no field")
    assert caught.value.param == "prompt_template"
    with pytest.raises(InvalidRequest, match="leave prompt_template empty"):
        cog_inputs.request_from_inputs(settings, prompt="hi", prompt_template="{prompt}", json_schema="{}")


def test_defaults_are_replicates_and_max_tokens_left_at_default_is_unset() -> None:
    body = cog_inputs.request_from_inputs(Settings(), prompt="hi")
    assert (body.max_tokens, body.min_tokens, body.temperature, body.top_p, body.top_k) == (
        None,  # the core fills it in: min(default, what the context leaves)
        0,
        0.6,
        0.9,
        50,
    )
    explicit = cog_inputs.request_from_inputs(Settings(), prompt="hi", max_tokens=600, min_tokens=3)
    assert explicit.max_tokens == 600
    assert bridge.runner_settings(None, Settings()).default_max_tokens == cog_inputs.DEFAULT_MAX_TOKENS == 512
    assert bridge.runner_settings(None, Settings(max_tokens_limit=100)).default_max_tokens == 100


def test_errors_name_the_cog_input() -> None:
    settings = Settings()
    with pytest.raises(InvalidRequest) as too_long:
        cog_inputs.request_from_inputs(settings, prompt="hi", stop_sequences="x" * 300)
    assert too_long.value.param == "stop_sequences" and too_long.value.message.startswith("stop_sequences:")
    with pytest.raises(InvalidRequest) as too_many:
        cog_inputs.request_from_inputs(settings, prompt="hi", stop_sequences="a,b,c,d,e")
    assert "stop_sequences takes up to 4" in too_many.value.message and "stop:" not in too_many.value.message
    with pytest.raises(InvalidRequest) as schema:
        cog_inputs.request_from_inputs(settings, prompt="hi", json_schema="[1]")
    assert schema.value.param == "json_schema" and "response_format" not in schema.value.message


@pytest.mark.timeout(20)
def test_a_request_id_conflict_names_request_id_and_a_dead_engine_says_already() -> None:
    engine = ScriptedEngine(auto=True)

    async def go() -> tuple[IdempotencyConflict, EngineUnavailable]:
        service = Service(Settings(), engine)
        first = cog_inputs.request_from_inputs(service.settings, prompt="a b", max_tokens=2)
        other = cog_inputs.request_from_inputs(service.settings, prompt="c d", max_tokens=2)
        (await bridge.start_generation(service, first, "same")).close()
        with pytest.raises(IdempotencyConflict) as conflict:
            await bridge.start_generation(service, other, "same")
        engine.healthy = lambda: False  # type: ignore[method-assign]  # the engine has died
        with pytest.raises(EngineUnavailable) as dead:
            await bridge.start_generation(service, other, None)
        return conflict.value, dead.value

    conflict, dead = asyncio.run(go())
    assert "request_id 'same' was already used" in conflict.message and "X-Request-Id" not in conflict.message
    assert conflict.param == "request_id"
    assert "already died before this prediction started" in dead.message
    assert len(engine.started) == 1  # the refused ones never reached the engine


def test_token_counts_come_from_the_generation() -> None:
    engine = ScriptedEngine(auto=True)
    recorded: dict[str, int] = {}

    async def go() -> list[str]:
        service = Service(Settings(), engine)
        body = cog_inputs.request_from_inputs(service.settings, prompt="one two three", max_tokens=5)
        subscription = await bridge.start_generation(service, body, None)
        pieces = [piece async for piece in subscription.text()]
        bridge.record_token_counts(subscription, recorded.__setitem__)
        subscription.close()
        return pieces

    assert "".join(asyncio.run(go())) == "t0 t1 t2 t3 t4 "
    assert recorded == {"input_token_count": 3, "output_token_count": 5}  # scripted: a token a word


# --- the real Cog server ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cog_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CogServer]:
    # The runner with holds (tests/cog_hold_runner.py), for the engine-death test at the end;
    # the predictions of every other test are not marked and run as under cog/predict.py.
    limits = {"BUNDLE_MAX_MODEL_LEN": str(MAX_MODEL_LEN)}
    log_dir = tmp_path_factory.mktemp("cog-inputs")
    with running_cog_server(log_dir, runner=HOLD_RUNNER_REF, **limits) as server:
        yield server


def predict(server: CogServer, **inputs: Any) -> dict[str, Any]:
    response = httpx.post(f"{server.url}/predictions", json={"input": inputs}, timeout=120)
    assert response.status_code == 200, response.text
    return dict(response.json())


def text_of(result: dict[str, Any]) -> str:
    assert result["status"] == "succeeded", result
    return "".join(result["output"])


GREEDY = {"prompt": "tell me a story", "temperature": 0, "max_tokens": 60, "seed": 1}


@pytest.fixture(scope="module")
def greedy(cog_server: CogServer) -> tuple[str, int, str]:
    """The greedy answer, and a stop that starts with whitespace somewhere inside it."""
    text = text_of(predict(cog_server, **GREEDY))
    at = next(i for i in range(3, len(text) - 1) if text[i].isspace() and not text[i + 1].isspace())
    return text, at, text[at : at + 2]


def test_a_stop_sequence_keeps_its_whitespace(cog_server: CogServer, greedy: tuple[str, int, str]) -> None:
    text, at, stop = greedy
    assert stop[0].isspace()
    assert text_of(predict(cog_server, **GREEDY, stop_sequences=stop)) == text[:at]
    assert text_of(predict(cog_server, **GREEDY, stop_sequences=json.dumps([stop]))) == text[:at]


def test_min_tokens_holds_a_stop_off(cog_server: CogServer, greedy: tuple[str, int, str]) -> None:
    text, at, stop = greedy
    result = predict(cog_server, **GREEDY, stop_sequences=stop, min_tokens=40)
    held = text_of(result)
    assert len(held) > at and held.startswith(text[:at])  # ran past the first stop
    assert result["metrics"]["output_token_count"] >= 40


def test_token_count_metrics(cog_server: CogServer) -> None:
    result = predict(cog_server, prompt="count me", max_tokens=12, min_tokens=12, temperature=0)
    metrics = result["metrics"]
    assert metrics["output_token_count"] == 12  # min_tokens = max_tokens: exactly 12
    chat = _tokenizer().apply_chat_template(
        [{"role": "user", "content": "count me"}], add_generation_prompt=True, tokenize=True
    )
    assert metrics["input_token_count"] == len(chat["input_ids"])  # a BatchEncoding
    assert metrics["engine_running_requests"] == 0


def test_prompt_template_is_sent_as_it_is(cog_server: CogServer) -> None:
    template = "SYSTEM: {system_prompt}\nUSER: {prompt}\nASSISTANT:"
    inputs = {"prompt": "hello there", "system_prompt": "be terse", "temperature": 0, "max_tokens": 8}
    result = predict(cog_server, **inputs, prompt_template=template)
    rendered = "SYSTEM: be terse\nUSER: hello there\nASSISTANT:"
    assert result["metrics"]["input_token_count"] == len(_tokenizer().encode(rendered))
    chat = predict(cog_server, **inputs)
    assert chat["metrics"]["input_token_count"] != result["metrics"]["input_token_count"]
    assert text_of(result)


def test_default_max_tokens_shrinks_to_the_context(cog_server: CogServer) -> None:
    prompt = "word " * 700  # leaves less than the default 512 of a 1024-token context
    result = predict(cog_server, prompt=prompt, temperature=0)
    metrics = result["metrics"]
    assert result["status"] == "succeeded", result
    assert MAX_MODEL_LEN - 512 < metrics["input_token_count"] < MAX_MODEL_LEN
    assert metrics["input_token_count"] + metrics["output_token_count"] <= MAX_MODEL_LEN
    explicit = predict(cog_server, prompt=prompt, max_tokens=600)
    assert explicit["status"] == "failed" and "context" in explicit["error"]


def test_failures_name_the_cog_input(cog_server: CogServer) -> None:
    too_many = predict(cog_server, prompt="hi", stop_sequences="a,b,c,d,e")
    assert too_many["status"] == "failed" and "stop_sequences" in too_many["error"]
    assert predict(cog_server, prompt="one", max_tokens=2, request_id="cog-inputs-1")["status"] == "succeeded"
    conflict = predict(cog_server, prompt="two", max_tokens=2, request_id="cog-inputs-1")
    assert conflict["status"] == "failed" and "request_id 'cog-inputs-1'" in conflict["error"]
    assert "X-Request-Id" not in conflict["error"]


def test_after_engine_death_nothing_runs_and_new_predictions_say_it_was_already_dead(
    cog_server: CogServer,
) -> None:
    """Last on purpose: it kills the module's engine, under a prediction that is streaming (held
    in the frozen engine by the gate, so vLLM holds it when its core dies)."""
    inputs = {**LONG, "max_tokens": 900, "min_tokens": 900, "seed": 7}
    stream, running = asyncio.run(engine_killed_under_a_prediction(cog_server, inputs))
    assert running == 1, "the engine did not hold the stream when it was killed"
    assert stream.completed is not None and "died during generation" in stream.completed["error"]
    assert _health_status(cog_server.url) == "UNHEALTHY"
    after = predict(cog_server, prompt="hi", max_tokens=5)
    assert after["status"] == "failed"
    assert after["metrics"]["engine_running_requests"] == 0, after["metrics"]
    assert "already died before this prediction started" in after["error"], after["error"]
    # The stats file the core publishes says the same (vLLM's own count, read after death).
    asyncio.run(until(lambda: cog_server.engine_running_requests() == 0, 30, "the stats file reads 0"))


def _tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(Path(resolve_model_path(Settings())))


def test_a_shared_store_reaches_the_runner_without_a_caveat(caplog: pytest.LogCaptureFixture) -> None:
    """With BUNDLE_REDIS_URL the runner keeps the store: predictions open generations through
    the same door as HTTP (tests/test_one_door.py follows one across both), so setup says
    nothing about a container-only match any more."""
    url = "redis://127.0.0.1:1/0"
    with caplog.at_level("WARNING", logger="cog_bridge"):
        settings = bridge.runner_settings(None, Settings(redis_url=url))
    assert settings.redis_url is not None and settings.redis_url.get_secret_value() == url
    assert caplog.text == ""
