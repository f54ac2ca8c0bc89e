"""BUNDLE_STREAM_INTERVAL through the whole bundle: a real server on the tiny model, read with
the official SDK. vLLM hands a stream's tokens out in groups after the first; the bundle must
turn each group into one chunk, lose nothing, and count every token."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.real_server import ServerProcess, bundle_server

TOKENS = 13  # 1 + 4 + 4 + 4 with an interval of 4: the first token alone, then full groups


@pytest.fixture(scope="module")
def chunked_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with bundle_server(tmp_path_factory.mktemp("stream-interval"), stream_interval="4") as server:
        yield server


def test_tokens_arrive_in_groups_of_the_interval_and_none_is_lost(chunked_server: ServerProcess) -> None:
    sdk = openai.OpenAI(base_url=f"{chunked_server.url}/v1", api_key="none", max_retries=0)

    def complete(stream: bool) -> Any:  # the same request both ways; greedy, so the same tokens
        return sdk.completions.create(
            model="tiny",
            prompt="Once upon",
            max_tokens=TOKENS,
            temperature=0.0,
            stream=stream,
            stream_options={"include_usage": True} if stream else openai.omit,
            extra_body={"ignore_eos": True},
        )

    whole = complete(stream=False)
    chunks = list(complete(stream=True))
    texts = [chunk.choices[0].text for chunk in chunks if chunk.choices]
    assert len(texts) == 4, texts  # one event per group, not one per token
    assert "".join(texts) == whole.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == TOKENS
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "length"
