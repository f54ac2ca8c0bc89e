"""The seam of a takeover, without an engine: where the continuation's prompt ends among the ids
already sent, with the tiny model's real byte-level tokenizer and vLLM's detokenizing
(`VLLMEngine.decode_steps`, DecodeStream primed with the prompt, as vLLM's own). The whole path
on the real engine, with the seam inside a character, is in tests/test_takeover.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from tokenizers import Tokenizer

from shared.engine.contract import EngineDelta
from shared.engine.vllm import VLLMEngine
from shared.errors import ProducerLost
from shared.models.tiny_model import ensure_model
from shared.replicas.store import DATA, KEPT, TOKENS
from shared.replicas.takeover import Recipe, after_sent, continuation_seed, plan, read_log
from shared.replicas.tokens import pack_ids
from shared.settings import Settings


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    settings = Settings()
    path = ensure_model(settings.cache_dir, settings.tiny_model_shape, settings.tiny_model_seed)
    return Tokenizer.from_file(str(path / "tokenizer.json"))


def steps(tokenizer: Tokenizer, prompt: list[int], ids: list[int]) -> list[str | None]:
    engine: Any = SimpleNamespace(_tokenizer=SimpleNamespace(_tokenizer=tokenizer))
    found = VLLMEngine.decode_steps(engine, prompt, ids, skip_special_tokens=True)
    assert found is not None
    return found


def recipe(max_tokens: int = 40, **sampling: Any) -> Recipe:
    given = {"max_tokens": max_tokens, "temperature": 0.0, "seed": None, **sampling}
    return Recipe("chat", "chatcmpl-x", 1, "tiny", True, True, [1, 2, 3], given)


def log(recipe: Recipe, text: str, ids: list[int]) -> list[tuple[int, dict[bytes, bytes]]]:
    chunk = {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
    opening = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    return [
        (1, {DATA: orjson.dumps(opening)}),
        (2, {DATA: orjson.dumps(chunk), TOKENS: pack_ids(ids)}),
    ]


def test_a_character_split_over_two_tokens_never_ends_the_prompt(tokenizer: Tokenizer) -> None:
    """ "ab é": "é" is two byte tokens here; vLLM sent "ab " and held the first byte's token back
    until the second came. The prompt goes on after "ab " only: the taker generates é whole."""
    ids = tokenizer.encode("ab é cd").ids
    assert [tokenizer.decode([i]) for i in ids[3:5]] == ["\ufffd", "\ufffd"]  # é: two byte tokens
    pieces = steps(tokenizer, [1, 2, 3], ids[:4])
    assert pieces[3] is None  # what vLLM streamed for the first byte: nothing yet
    sent = "".join(piece or "" for piece in pieces)
    assert sent == "ab "
    made = recipe()
    logged = read_log(log(made, sent, ids[:4]), made.encode())
    assert plan(logged, steps(tokenizer, made.prompt, logged.ids)) == plan_of(kept=3, resent="", remaining=37)


def test_text_held_back_for_a_stop_string_is_generated_again_and_checked(tokenizer: Tokenizer) -> None:
    """vLLM held back the last characters (they could start a stop string): the ids run ahead
    of the text sent, so the prompt ends before them and they are generated again."""
    ids = tokenizer.encode("once upon a time").ids
    whole = tokenizer.decode(ids)
    sent = whole[:-3]
    made = recipe(stop=["tim!"])
    logged = read_log(log(made, sent, ids), made.encode())
    found = plan(logged, steps(tokenizer, made.prompt, logged.ids))
    kept_text = tokenizer.decode(ids[: found.kept])
    assert found.kept < len(ids) and kept_text + found.resent == sent


def test_kept_marks_cut_the_ids_a_takeover_generated_again() -> None:
    made = recipe()
    entries = [
        (1, {DATA: b'{"choices":[{"index":0,"delta":{"content":"ab"}}]}', TOKENS: pack_ids([7, 8, 9])}),
        (2, {DATA: b'{"choices":[{"index":0,"delta":{"content":"c"}}]}', TOKENS: pack_ids([5, 6]), KEPT: b"2"}),
    ]
    logged = read_log(entries, made.encode())
    assert (logged.text, logged.ids, logged.gap) == ("abc", [7, 8, 5, 6], False)
    assert read_log([entries[1]], made.encode()).gap  # event 1 missing: a takeover refuses it
    assert plan(read_log([entries[1]], made.encode()), None).refusal is not None


async def deltas(*texts: str) -> AsyncIterator[EngineDelta]:
    for text in texts:
        yield EngineDelta(text=text, token_count=1)


async def test_text_generated_again_is_checked_then_left_out() -> None:
    out = [delta.text async for delta in after_sent(deltas("ti", "me", " went"), "time")]
    assert "".join(out) == " went"
    with pytest.raises(ProducerLost):
        [delta async for delta in after_sent(deltas("ti", "ny"), "time")]


def test_a_sampled_continuation_draws_the_same_seed_when_tried_again() -> None:
    greedy, sampled = recipe(seed=7), recipe(temperature=0.8, seed=7)
    assert continuation_seed(greedy, "id", 10) == 7
    assert continuation_seed(sampled, "id", 10) == continuation_seed(sampled, "other id", 10)
    assert continuation_seed(sampled, "id", 10) != continuation_seed(sampled, "id", 11)
    unseeded = recipe(temperature=0.8)
    assert continuation_seed(unseeded, "id", 10) == continuation_seed(unseeded, "id", 10)
    assert continuation_seed(unseeded, "id", 10) != continuation_seed(unseeded, "other id", 10)


def plan_of(**fields: Any) -> Any:
    from shared.replicas.takeover import Plan

    return Plan(**fields)
