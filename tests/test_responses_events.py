"""The chat-chunk -> Responses-event translation on its own (no engine): text then a tool call,
an error that means cancelled, and that the SDK parses each event into its own class."""

from __future__ import annotations

import hashlib
import typing
from typing import Any

from openai._models import construct_type
from openai.types.responses import ResponseStreamEvent

from shared.responses.events import ResponseFolder, base_object, rebuilt_events
from shared.responses.request import parse_responses_request


def folder() -> ResponseFolder:
    request = parse_responses_request({"model": "tiny", "input": "hi", "background": True})
    return ResponseFolder(base_object("resp_" + "ab" * 24, request, 1))


def chunk(**delta: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


def parsed(events: list[dict[str, Any]]) -> list[Any]:
    out = [construct_type(type_=ResponseStreamEvent, value=event) for event in events]
    for event in out:  # an unknown type would land in another class, whose literal differs
        assert event.type in typing.get_args(type(event).model_fields["type"].annotation), event.type
    return out


def test_text_then_a_tool_call_closes_the_message_first_and_numbers_every_event() -> None:
    fold = folder()
    events = fold.start()
    events += fold.on_chunk(chunk(content="Let me "))
    events += fold.on_chunk(chunk(content="look."))
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a"'}}
    events += fold.on_chunk(chunk(tool_calls=[call]))
    events += fold.on_chunk(chunk(tool_calls=[{"index": 0, "function": {"arguments": ": 1}"}}]))
    events += fold.on_chunk(
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12}}
    )
    events += fold.on_done()
    parsed(events)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds.index("response.output_item.done") < kinds.index("response.function_call_arguments.delta")
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and final["status"] == "completed"
    assert final["output"][0]["content"][0]["text"] == "Let me look."
    assert final["output"][1]["arguments"] == '{"a": 1}' and final["output"][1]["call_id"] == "call_1"
    assert final["usage"]["total_tokens"] == 12
    assert events[0]["response"]["status"] == "queued" and events[1]["response"]["status"] == "in_progress"


def test_a_cancel_error_ends_with_failed_and_status_cancelled() -> None:
    fold = folder()
    events = fold.start() + fold.on_chunk(chunk(content="x"))
    events += fold.on_chunk(
        {"error": {"message": "generation aborted: cancelled", "code": "request_cancelled"}}
    )
    assert fold.on_done() == []  # the [DONE] after the error adds nothing
    parsed(events)
    assert events[-1]["type"] == "response.failed" and events[-1]["response"]["status"] == "cancelled"
    assert events[-2]["type"] == "response.output_item.done"  # the open message is closed first
    assert events[-1]["response"]["error"] is None  # OpenAI's shape of a cancelled response


def test_item_ids_do_not_carry_the_response_id() -> None:
    fold = folder()
    events = fold.start() + fold.on_chunk(chunk(content="x"))
    call = {"index": 0, "type": "function", "function": {"name": "f", "arguments": "{}"}}
    events += fold.on_chunk(chunk(tool_calls=[call])) + fold.on_done()
    response_hex = fold.response["id"].removeprefix("resp_")
    ids = [item["id"] for item in fold.response["output"]] + [fold.response["output"][1]["call_id"]]
    assert [i.split("_")[0] for i in ids] == ["msg", "fc", "call"]
    assert all(response_hex[:8] not in i and i.split("_")[-1] not in response_hex for i in ids), ids


def test_rebuilt_events_of_a_final_object_parse_and_end_with_it() -> None:
    fold = folder()
    live = fold.start() + fold.on_chunk(chunk(content="a")) + fold.on_chunk(chunk(content="b"))
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    live += fold.on_chunk(chunk(tool_calls=[call])) + fold.on_done()
    rebuilt = rebuilt_events(fold.response)
    parsed(rebuilt)
    assert [e["sequence_number"] for e in rebuilt] == list(range(len(rebuilt)))
    assert rebuilt[-1]["response"] == live[-1]["response"] and rebuilt[0]["response"]["status"] == "queued"
    kinds = [e["type"] for e in live]
    assert [e["type"] for e in rebuilt] == [k for i, k in enumerate(kinds) if k != kinds[i - 1]]


def test_a_keyed_response_id_needs_the_deploys_secret() -> None:
    """Derived from the client's key so that every replica names a retry's response alike, and
    keyed with the API key so that a client key seen in a log does not name it."""
    from shared.responses.manager import response_id_for

    key = "client-retry-key"
    named = response_id_for(key, b"sk-a")
    assert named == response_id_for(key, b"sk-a")  # every replica of one deploy agrees
    assert named != response_id_for(key, b"sk-b") and named != response_id_for(key)
    plain = "resp_" + hashlib.sha256(b"bundle-responses\0" + key.encode()).hexdigest()[:48]
    assert named != plain and len(named) == len(plain)
    assert response_id_for(None, b"sk-a") != response_id_for(None, b"sk-a")  # random without a key


def test_a_bad_input_item_is_named_by_its_own_field() -> None:
    """Not by a branch of the input's union (`input.constrained-str`, what it said before)."""
    import pytest

    from shared.errors import InvalidRequest

    cases = [
        (
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "x", "x": 1}]},
            "input.1.content.0.x",
        ),
        ({"type": "message", "role": "robot", "content": "x"}, "input.1.role"),
        ({"type": "function_call", "call_id": "c", "name": "f"}, "input.1.arguments"),
        ("not an object", "input.1"),
        ({"role": "user", "content": ["not an object"]}, "input.1.content.0"),
    ]
    for item, param in cases:
        with pytest.raises(InvalidRequest) as refused:
            parse_responses_request({"model": "tiny", "input": [{"role": "user", "content": "a"}, item]})
        assert refused.value.param == param, (item, refused.value)
    echoed = {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "x", "annotations": [], "logprobs": []}],
    }
    assert parse_responses_request({"model": "tiny", "input": [echoed]}).input[0].text == "x"  # type: ignore[union-attr]
