"""Options of the Responses API that OpenAI clients (the Agents SDK among them) may send, through
the official `openai` SDK against a real server on the real vLLM CPU engine: those that cannot
change the output are accepted and ignored, those that would are a 400 naming the parameter."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from shared.service import Service
from tests.conftest import LiveServers

GREEDY: dict[str, Any] = {"model": "tiny", "input": "hi there", "max_output_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def server(live: LiveServers) -> tuple[str, Service]:
    return live.serve()


@pytest.fixture
def client(server: tuple[str, Service]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0, timeout=120) as sdk:
        yield sdk


def test_prompt_cache_and_safety_options_are_accepted_and_change_nothing(client: openai.OpenAI) -> None:
    """Prefix caching is automatic here: a retention or cache key asks for nothing the engine
    does not do anyway, and a safety identifier is for OpenAI's abuse monitoring. Greedy, the
    answer is the one the same request gets without them."""
    plain = client.responses.create(**GREEDY)
    for retention in ("24h", "in_memory"):
        asked = client.responses.create(
            **GREEDY,
            prompt_cache_retention=retention,  # type: ignore[arg-type]
            prompt_cache_key="agent-42",
            safety_identifier="user-hash-1",
        )
        assert asked.status == plain.status and asked.output_text == plain.output_text
    assert plain.output_text


@pytest.mark.parametrize(
    ("option", "words"),
    [
        ({"conversation": "conv_123"}, "previous_response_id"),
        ({"conversation": {"id": "conv_123"}}, "previous_response_id"),
        ({"prompt": {"id": "pmpt_123", "variables": {"city": "Paris"}}}, "instructions and input"),
        ({"context_management": [{"type": "compaction", "compact_threshold": 1000}]}, "compaction"),
    ],
)
def test_options_that_would_change_the_output_are_a_400_naming_them(
    client: openai.OpenAI, option: dict[str, Any], words: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(**GREEDY, **option)
    error = refused.value.body
    (name,) = option
    assert isinstance(error, dict) and error["param"] == name and error["code"] == "unsupported_parameter"
    assert error["message"].startswith(f"{name} is not supported") and words in error["message"]


def test_an_unknown_prompt_cache_retention_is_a_400_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(**GREEDY, prompt_cache_retention="1h")  # type: ignore[arg-type]
    error = refused.value.body
    assert isinstance(error, dict) and error["param"] == "prompt_cache_retention"
