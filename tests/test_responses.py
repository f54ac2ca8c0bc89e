"""The Responses API (issue 30) against a real server on the real vLLM CPU engine, through the
official `openai` SDK: background mode, resume with `starting_after`, cancel, chained turns,
identity, storage and bad input."""

from __future__ import annotations

import asyncio
import gc
import json
import time
import typing
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from shared.responses.manager import Responses
from shared.responses.request import parse_responses_request
from shared.service import Service
from tests.conftest import LiveServers, wait_until
from tests.gate import Gate

LONG = 1500  # output tokens: a response held mid-way (tests/gate.py) while a test acts on it
# Engine deltas let through before a hold: enough for the few text deltas a test reads first (a
# delta that completes no character carries no text and makes no event).
HOLD_AFTER = 24
# The tiny model's random weights almost never choose to stop, so a response that must end as
# `completed` (not `incomplete` at max_output_tokens) is held to a JSON schema with one allowed
# value: the grammar ends it, after a couple of dozen forced tokens.
SENTENCE = "the quick brown fox jumps over the lazy dog and runs far away into the woods"
ENDS = {
    "format": {
        "type": "json_schema",
        "name": "fixed",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {"story": {"type": "string", "enum": [SENTENCE]}},
            "required": ["story"],
            "additionalProperties": False,
        },
    }
}


@pytest.fixture(scope="module")
def server(live: LiveServers) -> tuple[str, Service]:
    return live.serve(responses_retention_s=60.0)


@pytest.fixture
def client(server: tuple[str, Service]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0, timeout=120) as sdk:
        yield sdk


def parsed_faithfully(event: Any) -> bool:
    """The SDK parsed the event into the class of its own type (an unknown type silently lands
    in the union's first class, whose `type` literal then does not match)."""
    return event.type in typing.get_args(type(event).model_fields["type"].annotation)


def text_of(events: list[Any]) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


def test_background_stream_resumes_after_a_drop_with_no_gap_and_no_duplicate(client: openai.OpenAI) -> None:
    args = {
        "model": "tiny",
        "input": "tell me a story",
        "max_output_tokens": 200,
        "temperature": 0,
        "text": ENDS,
    }
    first = client.responses.create(**args, background=True, stream=True)
    seen = [next(first) for _ in range(5)]
    first.close()  # the client drops the connection
    response_id = seen[0].response.id
    k = seen[-1].sequence_number
    rest = list(client.responses.retrieve(response_id, stream=True, starting_after=k))

    numbers = [e.sequence_number for e in seen + rest]
    assert numbers == list(range(len(numbers))), numbers  # from 0, each once, in order
    assert rest[0].sequence_number == k + 1
    assert rest[-1].type == "response.completed"
    assert all(parsed_faithfully(e) for e in seen + rest)
    assert [e.type for e in seen[:2]] == ["response.created", "response.in_progress"]
    assert seen[0].response.status == "queued" and seen[0].response.background is True

    plain = client.responses.create(**args)  # not background, not streamed
    assert plain.status == "completed" and plain.output_text
    assert text_of(seen + rest) == plain.output_text
    final = client.responses.retrieve(response_id)
    assert final.status == "completed" and final.output_text == plain.output_text
    assert final.usage is not None and final.usage.output_tokens == plain.usage.output_tokens  # type: ignore[union-attr]
    assert rest[-1].response.output_text == plain.output_text
    assert SENTENCE in plain.output_text and len(rest) > 10


def test_the_sdk_stream_helper_accepts_every_event(client: openai.OpenAI) -> None:
    with client.responses.stream(model="tiny", input="hello", max_output_tokens=200, text=ENDS) as stream:  # type: ignore[arg-type]
        events = list(stream)
        final = stream.get_final_response()
    assert all(parsed_faithfully(e) for e in events)
    assert final.status == "completed" and final.output_text == text_of(events)
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]


def test_background_poll_reports_progress_and_usage(client: openai.OpenAI) -> None:
    created = client.responses.create(
        model="tiny", input="count", max_output_tokens=30, background=True, temperature=0
    )
    assert created.status == "queued" and created.id.startswith("resp_") and len(created.id) >= 40
    statuses = []

    def ended() -> bool:
        statuses.append(client.responses.retrieve(created.id).status)
        return statuses[-1] in ("completed", "incomplete")

    wait_until(ended, timeout=50, interval=0.05)
    assert set(statuses) <= {"queued", "in_progress", "incomplete"}, statuses
    done = client.responses.retrieve(created.id)
    assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"  # type: ignore[union-attr]
    assert done.usage is not None and done.usage.output_tokens > 0 and done.usage.input_tokens > 0
    assert done.output_text


def test_cancel_mid_stream_gives_cancelled(client: openai.OpenAI, gate: Gate) -> None:
    held = gate.close(after=HOLD_AFTER)  # released by the gate fixture
    stream = client.responses.create(
        model="tiny", input=held.prompt("go on"), max_output_tokens=LONG, background=True, stream=True
    )
    held.wait_held()  # it cannot end before the cancel
    seen = [next(stream) for _ in range(6)]
    cancelled = client.responses.cancel(seen[0].response.id)
    assert cancelled.status == "cancelled"
    rest = list(stream)
    assert rest[-1].type == "response.failed" and rest[-1].response.status == "cancelled"
    assert all(parsed_faithfully(e) for e in rest)
    assert client.responses.retrieve(seen[0].response.id).status == "cancelled"


def test_previous_response_id_chains_two_turns(client: openai.OpenAI) -> None:
    first = client.responses.create(model="tiny", input="my name is Ada", max_output_tokens=8, temperature=0)
    second = client.responses.create(
        model="tiny",
        input="what is my name?",
        previous_response_id=first.id,
        max_output_tokens=8,
        temperature=0,
    )
    assert second.status in ("completed", "incomplete") and second.previous_response_id == first.id
    alone = client.responses.create(model="tiny", input="what is my name?", max_output_tokens=8, temperature=0)
    assert first.usage is not None and second.usage is not None and alone.usage is not None
    # The second turn's prompt holds the first turn's input and output before its own input.
    assert second.usage.input_tokens >= alone.usage.input_tokens + first.usage.output_tokens + 3


def test_the_same_request_id_names_one_response_and_a_different_body_is_422(
    client: openai.OpenAI, server: tuple[str, Service]
) -> None:
    body = {"model": "tiny", "input": "once", "max_output_tokens": 10, "temperature": 0}
    headers = {"X-Request-Id": "responses-identity-1"}
    with httpx.Client(base_url=server[0], timeout=60) as http:
        one = http.post("/v1/responses", json=body, headers=headers)
        two = http.post("/v1/responses", json=body, headers=headers)
        other = http.post("/v1/responses", json={**body, "input": "twice"}, headers=headers)
    assert one.status_code == two.status_code == 200
    assert one.json()["id"] == two.json()["id"] and one.json()["output"] == two.json()["output"]
    assert other.status_code == 422 and other.json()["error"]["code"] == "request_id_conflict"


def test_delete_removes_and_an_unknown_id_is_a_clear_404(client: openai.OpenAI) -> None:
    made = client.responses.create(model="tiny", input="x", max_output_tokens=4)
    client.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError) as gone:
        client.responses.retrieve(made.id)
    assert "expired after the retention" in str(gone.value)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.content.0.type",
        ),
        ({"input": [{"type": "input_file", "file_id": "f"}]}, "input.0.type"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"input": "hi", "temperature": 3}, "temperature"),
        ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning.effort"),
        ({"input": "hi", "include": ["message.output_text.logprobs"]}, "include.0"),
        ({"input": "hi", "include": ["not.a.thing"]}, "include.0"),
        ({"input": "hi", "truncation": "auto"}, "truncation"),
        ({"input": "hi", "background": True, "store": False}, None),
    ],
)
def test_bad_input_is_a_400_naming_the_field(
    client: openai.OpenAI, body: dict[str, Any], param: str | None
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="tiny", **body)
    error = refused.value.body
    assert isinstance(error, dict) and error["param"] == param and error["message"]


def test_the_options_an_agents_sdk_sends_by_default_are_accepted(client: openai.OpenAI) -> None:
    """The OpenAI Agents SDK (0.24) sends `include` with every request, an empty list unless a
    tool or setting asks for more; `truncation: disabled` and a reasoning effort of `none` are
    what this server does anyway. Includes that extend items it never makes add nothing."""
    made = client.responses.create(
        model="tiny",
        input="hi",
        include=[],
        truncation="disabled",
        reasoning={"effort": "none"},  # type: ignore[typeddict-item]
        max_output_tokens=4,
        temperature=0,
    )
    assert made.status in ("completed", "incomplete") and made.output_text
    vacuous = client.responses.create(
        model="tiny", input="hi", include=["reasoning.encrypted_content"], max_output_tokens=4, temperature=0
    )
    assert vacuous.output_text == made.output_text  # greedy: the same answer, nothing added
    assert [item.type for item in vacuous.output] == ["message"]


def test_a_conversation_kept_by_the_client_sends_the_output_back_as_input(client: openai.OpenAI) -> None:
    """OpenAI's stateless pattern (and the Agents SDK's): the next request's input is the history
    plus the previous response's output items as the SDK returned them, `output_text` parts
    with their `annotations` and `logprobs` lists. That was a 400 while parts took no logprobs."""
    history: list[Any] = [{"role": "user", "content": "hi"}]
    first = client.responses.create(model="tiny", input=history, max_output_tokens=4, temperature=0)
    history += first.output
    history.append({"role": "user", "content": "and again"})
    second = client.responses.create(model="tiny", input=history, max_output_tokens=4, temperature=0)
    assert second.output_text and second.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens  # type: ignore[union-attr]


def test_structured_output_and_function_tools_reuse_the_chat_path(client: openai.OpenAI) -> None:
    structured = client.responses.create(
        model="tiny",
        input="a story",
        text=ENDS,  # type: ignore[arg-type]
        max_output_tokens=200,
        temperature=0,
    )
    assert json.loads(structured.output_text) == {"story": SENTENCE}
    zones = {"type": "string", "enum": ["UTC", "CET"]}
    parameters = {
        "type": "object",
        "properties": {"tz": zones},
        "required": ["tz"],
        "additionalProperties": False,
    }
    tool = {"type": "function", "name": "get_time", "parameters": parameters}
    called = client.responses.create(
        model="tiny",
        input="time?",
        tools=[tool],
        tool_choice={"type": "function", "name": "get_time"},
        max_output_tokens=60,  # type: ignore[list-item]
        temperature=0,  # greedy: a status is asserted, and a sampled call may run long
    )
    calls = [item for item in called.output if item.type == "function_call"]
    assert called.status == "completed", called
    assert calls and calls[0].name == "get_time" and json.loads(calls[0].arguments)["tz"] in ("UTC", "CET")


def test_a_retry_after_the_core_forgot_never_runs_the_model_again(live: LiveServers) -> None:
    """The core forgets a generation after `retention_s` (here 1 s); the stored response lives on.
    A retry with its key answers the stored object (sampled text: a second run would differ)."""
    base, _ = live.serve(retention_s=1.0, responses_retention_s=60.0)
    body = {"model": "tiny", "input": "once", "max_output_tokens": 16, "temperature": 1.0}
    with httpx.Client(base_url=base, timeout=60) as http:
        for mode, headers in [
            ({}, {"X-Request-Id": "forgot-1"}),
            ({"stream": True}, {"Idempotency-Key": "forgot-2"}),
        ]:
            first = http.post("/v1/responses", json={**body, **mode}, headers=headers)
            first_text = first.text
            done = http.get(f"/v1/responses/{_id_of(first)}").json()
            time.sleep(2.5)  # past the core's retention
            again = http.post("/v1/responses", json={**body, **mode}, headers=headers)
            other = http.post("/v1/responses", json={**body, **mode, "input": "twice"}, headers=headers)
            assert again.status_code == 200, again.text
            assert _final_of(again) == done and done["status"] in ("completed", "incomplete"), first_text
            assert other.status_code == 422 and other.json()["error"]["code"] == "request_id_conflict"


def _sse_data(reply: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: ")]


def _id_of(reply: httpx.Response) -> str:
    if reply.headers["content-type"].startswith("text/event-stream"):
        return str(_sse_data(reply)[0]["response"]["id"])
    return str(reply.json()["id"])


def _final_of(reply: httpx.Response) -> dict[str, Any]:
    """The Response object a create answered: its JSON, or its stream's terminal event's."""
    if reply.headers["content-type"].startswith("text/event-stream"):
        return dict(_sse_data(reply)[-1]["response"])
    return dict(reply.json())


def test_a_stored_plain_stream_whose_client_leaves_is_stored_final(live: LiveServers) -> None:
    """Not background, store=true: the client reads a few events and leaves; the response still
    runs to its end and its final object is stored (GET after the core forgot the events)."""
    base, service = live.serve(retention_s=1.0, responses_retention_s=60.0)
    with openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120) as sdk:
        stream = sdk.responses.create(
            model="tiny", input="go", max_output_tokens=40, stream=True, temperature=0
        )
        seen = [next(stream) for _ in range(4)]
        stream.close()
        response_id = seen[0].response.id
        wait_until(lambda: service.stats()["running_generations"] == 0, timeout=60)  # its end
        time.sleep(2.0)  # then past the core's retention of its events (1 s after that end)
        final = sdk.responses.retrieve(response_id)
    assert final.status == "incomplete" and final.usage is not None, final
    assert final.usage.output_tokens == 40 and final.output_text


def test_a_stream_left_after_its_first_event_leaves_no_reader_behind(live: LiveServers) -> None:
    """Readers of a running response left right after `response.created` (the moment an HTTP
    stream whose client leaves can stop at) close their subscription: once the response ended,
    no reader is left on the core."""
    _, service = live.serve(responses_retention_s=60.0)

    async def leave_early() -> int:
        responses = Responses(service)
        body = {"model": "tiny", "input": "go", "max_output_tokens": 40, "background": True}
        created = await responses.create(parse_responses_request(body), None)
        events = await responses.events(created.record["id"], None)
        assert (await anext(events))["type"] == "response.created"
        await events.aclose()  # type: ignore[attr-defined]
        await asyncio.gather(*responses._keepers)  # the response's end
        gc.collect()  # a generator left suspended is finalized now
        # Its clean-up runs in the loop's next turns: wait for them (a leaked reader never goes).
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while service.stats()["subscribers"] and loop.time() < deadline:
            await asyncio.sleep(0.05)
        subscribers = service.stats()["subscribers"]
        await responses.aclose()
        return subscribers

    assert live.call(leave_early()) == 0


def test_a_finished_response_streams_again_after_its_log_expired(live: LiveServers) -> None:
    """After the core forgot the events (retention_s=1), a stream of a finished response is
    rebuilt from the stored object: the live stream's event types (one delta), numbered afresh."""
    base, _ = live.serve(retention_s=1.0, responses_retention_s=60.0)
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 12, "stream": True, "temperature": 0}
    with httpx.Client(base_url=base, timeout=60) as http:
        live_events = _sse_data(http.post("/v1/responses", json=body))
        response_id = live_events[0]["response"]["id"]
        time.sleep(2.5)
        again = _sse_data(http.get(f"/v1/responses/{response_id}", params={"stream": "true"}))
        later = _sse_data(
            http.get(f"/v1/responses/{response_id}", params={"stream": "true", "starting_after": "3"})
        )
        final = http.get(f"/v1/responses/{response_id}").json()
    assert final["status"] == "incomplete" and again[-1]["response"] == final == live_events[-1]["response"]
    kinds = [e["type"] for e in live_events]
    one_delta = [k for i, k in enumerate(kinds) if not (k.endswith(".delta") and kinds[i - 1] == k)]
    assert [e["type"] for e in again] == one_delta
    assert [e["sequence_number"] for e in again] == list(range(len(again)))
    assert (
        "".join(e["delta"] for e in again if e["type"].endswith(".delta"))
        == final["output"][0]["content"][0]["text"]
    )
    assert later == again[4:]


def test_a_background_create_retried_after_its_end_answers_the_final_object(
    server: tuple[str, Service],
) -> None:
    body = {"model": "tiny", "input": "bg", "max_output_tokens": 8, "background": True, "temperature": 0}
    headers = {"Idempotency-Key": "responses-background-retry-1"}
    with httpx.Client(base_url=server[0], timeout=60) as http:
        first = http.post("/v1/responses", json=body, headers=headers).json()
        assert first["status"] == "queued"
        url = f"/v1/responses/{first['id']}"
        wait_until(lambda: http.get(url).json()["status"] == "incomplete", timeout=60)
        again = http.post("/v1/responses", json=body, headers=headers)
        assert again.status_code == 200 and again.json() == http.get(url).json()
        assert again.json()["status"] == "incomplete" and again.json()["output"]
