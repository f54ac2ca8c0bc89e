"""OpenAI API breadth on the REAL engine (CPU build, random-weight tiny model) through the official
`openai` SDK: content parts, structured output, tools, logprobs, n > 1, vLLM's extra sampling
fields; and all of it through request identity (dedup, replay, resume byte-identical).

The tiny model writes gibberish, so every check here is one the grammar or the engine guarantees
(valid JSON for a schema, a forced call's name, greedy = top-1), not one about the text's sense.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import httpx
import jsonschema
import openai
import orjson
import pytest
from pydantic import BaseModel, Field

from shared.service import Service
from tests.gate import Gate
from tests.test_api import sse_events
from tests.test_identity import read_events

WEATHER = {
    "type": "object",
    "properties": {
        # A pattern, not any string: see Person below (a raw control character in a string).
        "city": {"type": "string", "pattern": "^[a-z ]{1,12}$"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
WEATHER_CHOICE = {"type": "function", "function": {"name": "get_weather"}}
UNKNOWN_CHOICE = {"type": "function", "function": {"name": "no_such_tool"}}
JSON_MODE = {"type": "json_object"}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# Engine deltas of a forced call before the gate holds it: a few tokens into its arguments (the
# JSON's opening tokens), far below its length (`{"city": ..., "unit": ...}`).
TOOL_HOLD_AFTER = 4
N_CHOICE_TOKENS = 128  # each choice's length in the interleaved stream (see that test)


class Person(BaseModel):
    # A pattern rather than any string: with vLLM 0.32.0's xgrammar backend, strings of the tiny
    # model's output carried raw control characters (0x05 and others, twice in ~10 runs), which
    # JSON forbids and the SDK's parsers reject. Not root-caused (xgrammar's own string rule
    # excludes them); see the report of issue 15.
    name: str = Field(pattern=r"^[a-z ]{1,10}$")
    mood: Literal["happy", "sad"]
    awake: bool


@pytest.fixture
def sdk(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def generations(service: Service) -> float:
    return float(service.metrics.engine_generations._value.get())


def chunks_of(raw: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(data) for _, data in sse_events(raw) if data != b"[DONE]"]


def joined_arguments(chunks: list[dict[str, Any]]) -> dict[int, dict[str, str]]:
    """Tool calls reassembled from streamed deltas: call index -> id, name, arguments."""
    calls: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            for delta in choice["delta"].get("tool_calls") or ():
                call = calls.setdefault(delta["index"], {"id": "", "name": "", "arguments": ""})
                call["id"] = delta.get("id") or call["id"]
                call["name"] = delta.get("function", {}).get("name") or call["name"]
                call["arguments"] += delta.get("function", {}).get("arguments") or ""
    return calls


# --- structured output ------------------------------------------------------------------------
def test_parse_with_a_pydantic_model_returns_the_parsed_object(sdk: openai.OpenAI) -> None:
    reply = sdk.chat.completions.parse(
        model="tiny", messages=MESSAGES, response_format=Person, max_tokens=60, temperature=1.0
    )
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, Person), reply.choices[0].message.content


def test_parse_streaming_with_a_pydantic_model(sdk: openai.OpenAI) -> None:
    with sdk.chat.completions.stream(
        model="tiny", messages=MESSAGES, response_format=Person, max_tokens=60, temperature=1.0
    ) as stream:
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, Person)


def test_json_object_mode_gives_a_json_object(sdk: openai.OpenAI) -> None:
    reply = sdk.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        response_format={"type": "json_object"},
        max_tokens=60,
        temperature=0.0,
    )
    assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)


# --- tools ------------------------------------------------------------------------------------
def test_forced_tool_call_streams_arguments_valid_for_the_schema(base_url: str, gate: Gate) -> None:
    """Streamed, not sent whole at the end: a piece of the arguments reaches the client while the
    generation is held in the engine (so before it could end), the rest after the release; joined,
    they are valid for the schema."""
    with gate.hold(after=TOOL_HOLD_AFTER) as held:
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": held.prompt(MESSAGES[0]["content"])}],
            "tools": TOOLS,
            "tool_choice": WEATHER_CHOICE,
            "max_tokens": 60,
            "stream": True,
        }
        # A read timeout, so a server that sent no piece before the hold fails instead of hanging.
        sdk = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        stream = iter(sdk.chat.completions.create(**body))  # type: ignore[call-overload]
        chunks: list[dict[str, Any]] = []
        while not joined_arguments(chunks).get(0, {}).get("arguments"):
            chunk = next(stream, None)
            assert chunk is not None, "the stream ended before any piece of the arguments"
            chunks.append(chunk.model_dump())
        held.wait_held()  # the generation is held: that piece came before its end
        piece = joined_arguments(chunks)[0]["arguments"]
        held.release()
        chunks += [chunk.model_dump() for chunk in stream]
    calls = joined_arguments(chunks)
    assert list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert calls[0]["arguments"].startswith(piece) and len(calls[0]["arguments"]) > len(piece)
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_required_tool_choice_calls_one_of_the_tools(sdk: openai.OpenAI) -> None:
    reply = sdk.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls or []
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])  # type: ignore[union-attr]


def test_auto_tool_choice_is_parsed_by_vllms_llama3_json_parser(sdk: openai.OpenAI) -> None:
    # The random model never writes a call by itself; a response_format in the Llama 3.1 call
    # shape makes it, and the real parser (BUNDLE_TOOL_CALL_PARSER=llama3_json) must find it.
    # get_time has no arguments, so the call is short and always complete within max_tokens.
    no_arguments = {"type": "object", "properties": {}, "additionalProperties": False}
    call_shape = {
        "type": "object",
        "properties": {"name": {"const": "get_time"}, "parameters": no_arguments},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "call", "schema": call_shape}}
    common: dict[str, Any] = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=40, temperature=0.0)
    whole = sdk.chat.completions.create(**common, response_format=fmt)  # type: ignore[call-overload]
    (call,) = whole.choices[0].message.tool_calls or []
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_time", {}), whole
    # "length" when the random model pads the finished call with whitespace up to max_tokens.
    assert whole.choices[0].finish_reason in ("tool_calls", "length"), whole
    streamed = [c.model_dump() for c in sdk.chat.completions.create(**common, response_format=fmt, stream=True)]
    calls = joined_arguments(streamed)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_time", {})]


def test_a_conversation_with_a_tool_message_round_trips(sdk: openai.OpenAI) -> None:
    first = sdk.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=WEATHER_CHOICE, max_tokens=60
    )  # type: ignore[call-overload]
    call = (first.choices[0].message.tool_calls or [])[0]
    conversation = [
        *MESSAGES,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"},
    ]
    second = sdk.chat.completions.create(model="tiny", messages=conversation, tools=TOOLS, max_tokens=8)  # type: ignore[call-overload]
    assert second.choices[0].message.content is not None
    assert second.usage and first.usage
    # The call and its result are in the prompt: it grew by at least the tool result's tokens.
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 5


# --- logprobs, n, content parts ---------------------------------------------------------------
def test_top_logprobs_are_consistent_with_the_chosen_token(sdk: openai.OpenAI) -> None:
    reply = sdk.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=6, temperature=0.0, logprobs=True, top_logprobs=5
    )
    choice = reply.choices[0]
    entries = (choice.logprobs and choice.logprobs.content) or []
    assert len(entries) == reply.usage.completion_tokens  # type: ignore[union-attr]
    assert "".join(e.token for e in entries) == choice.message.content
    for entry in entries:
        assert len(entry.top_logprobs) == 5
        best = entry.top_logprobs[0]
        assert (best.token, best.logprob) == (entry.token, entry.logprob)  # greedy: the top one
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )
        assert entry.bytes == list(entry.token.encode())


def test_completions_logprobs_stream_and_whole_agree(sdk: openai.OpenAI) -> None:
    args: dict[str, Any] = dict(model="tiny", prompt="Once upon", max_tokens=5, temperature=0.0, logprobs=3)
    whole = sdk.completions.create(**args).choices[0]
    assert whole.logprobs is not None and len(whole.logprobs.tokens or []) == 5
    assert all(len(top) >= 3 for top in whole.logprobs.top_logprobs or [])
    assert "".join(whole.logprobs.tokens or []) == whole.text
    streamed = [c.choices[0].logprobs for c in sdk.completions.create(**args, stream=True) if c.choices]
    tokens = [t for lp in streamed if lp for t in lp.tokens or []]
    assert tokens == whole.logprobs.tokens


def test_n_choices_in_one_response_and_interleaved_in_one_stream(sdk: openai.OpenAI) -> None:
    whole = sdk.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, n=3, seed=3)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert all(c.message.content and c.finish_reason for c in whole.choices)
    # Interleaved as the engine writes the choices, step by step. vLLM merges the outputs a
    # reader has not taken yet (one per choice), so a stream whose first read came after every
    # step would carry the choices one after another: 128 steps make that a stall of the API's
    # loop from the request's first step to its last, not a loaded box's pause.
    stream = sdk.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=N_CHOICE_TOKENS,
        n=3,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    order = []
    finished = set()
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            order.append(choice.index)
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1, 2}
    assert usage is not None and usage.completion_tokens == 3 * N_CHOICE_TOKENS
    # Interleaved: some chunk of a later choice comes before the last chunk of an earlier one.
    assert any(order.index(later) < max(i for i, x in enumerate(order) if x == 0) for later in (1, 2))


def test_content_parts_give_the_same_tokens_as_a_string(sdk: openai.OpenAI) -> None:
    def greedy(content: Any) -> str | None:
        reply = sdk.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": content}], max_tokens=12, temperature=0.0
        )
        return reply.choices[0].message.content

    parts = [{"type": "text", "text": "Say "}, {"type": "text", "text": "something."}]
    assert greedy(parts) == greedy("Say something.")


def test_vllm_sampling_fields_take_effect(http: httpx.Client) -> None:
    base = {"model": "tiny", "prompt": "a", "temperature": 1.0, "max_tokens": 6, "logprobs": 0}
    biased = http.post("/v1/completions", json={**base, "logit_bias": {"300": 100}}).json()
    tokens = biased["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 6 and len(set(tokens)) == 1  # +100 on one id: nothing else is sampled
    extras = {"repetition_penalty": 1.2, "min_p": 0.05, "min_tokens": 4, "skip_special_tokens": False}
    ok = http.post("/v1/completions", json={**base, **extras, "stop_token_ids": [2]})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 4


def test_stop_string_is_kept_with_include_stop_str_in_output(http: httpx.Client) -> None:
    base = {"model": "tiny", "prompt": "a", "max_tokens": 30, "temperature": 0.0}
    text = http.post("/v1/completions", json=base).json()["choices"][0]["text"]
    stop = next(c for c in text[3:] if c.strip())
    kept = http.post(
        "/v1/completions", json={**base, "stop": [stop], "include_stop_str_in_output": True}
    ).json()
    assert kept["choices"][0]["text"] == text[: text.index(stop) + 1]


def test_explicit_null_means_not_set(http: httpx.Client, service: Service) -> None:
    plain = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4}
    nulls = {
        **plain,
        "temperature": None,
        "seed": None,
        "logprobs": None,
        "n": None,
        "stop": None,
        "tools": None,
    }
    headers = {"X-Request-Id": "nulls-are-unset"}
    first = http.post("/v1/chat/completions", json=nulls, headers=headers)
    assert first.status_code == 200, first.text
    before = generations(service)
    again = http.post("/v1/chat/completions", json=plain, headers=headers)  # same request: a replay
    assert again.status_code == 200 and again.json() == first.json()
    assert generations(service) == before


# --- identity: dedup, replay, resume ----------------------------------------------------------
async def _cut_and_resume(base_url: str, body: dict[str, Any], request_id: str, k: int) -> tuple[bytes, bytes]:
    """Read k events, drop the connection, resume after k; return (reassembled, full replay)."""
    headers = {"X-Request-Id": request_id}
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as cut:
            first_part = b"".join(await read_events(cut, k))
        resumed = await client.post(
            "/v1/chat/completions", json=body, headers={**headers, "Last-Event-ID": str(k)}
        )
        replay = await client.post("/v1/chat/completions", json=body, headers=headers)
    return first_part + resumed.content, replay.content


async def test_tool_call_stream_resumes_byte_identically(base_url: str, service: Service) -> None:
    body = {
        "model": "tiny",
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": WEATHER_CHOICE,
        "max_tokens": 60,
        "temperature": 1.0,
        "stream": True,
    }
    before = generations(service)
    reassembled, replay = await _cut_and_resume(base_url, body, "tool-resume", k=3)
    assert reassembled == replay
    assert generations(service) - before == 1
    calls = joined_arguments(chunks_of(replay))
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER)


async def test_n3_logprobs_stream_resumes_byte_identically(base_url: str, service: Service) -> None:
    body = {
        "model": "tiny",
        "messages": MESSAGES,
        "n": 3,
        "logprobs": True,
        "top_logprobs": 2,
        "max_tokens": 10,
        "ignore_eos": True,
        "temperature": 1.0,
        "stream": True,
    }
    before = generations(service)
    reassembled, replay = await _cut_and_resume(base_url, body, "n3-resume", k=5)
    assert reassembled == replay
    assert generations(service) - before == 1
    indices = {choice["index"] for chunk in chunks_of(replay) for choice in chunk["choices"]}
    assert indices == {0, 1, 2}


async def test_same_id_with_different_tools_is_422(base_url: str, service: Service) -> None:
    body = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 4}
    headers = {"X-Request-Id": "tools-conflict"}
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        assert (await client.post("/v1/chat/completions", json=body, headers=headers)).status_code == 200
        before = generations(service)
        other = await client.post("/v1/chat/completions", json={**body, "tools": TOOLS[:1]}, headers=headers)
    assert other.status_code == 422
    assert other.json()["error"]["code"] == "request_id_conflict"
    assert generations(service) == before


# --- bad input: 400 before the engine ---------------------------------------------------------
def user(content: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}]}


def schema_format(schema: Any) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


def one_tool(parameters: Any) -> dict[str, Any]:
    return {"tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}]}


# Valid JSON Schema that vLLM's xgrammar backend (the one compact JSON names) refuses to compile:
# vLLM itself refuses it when the request reaches the engine, which must not be a 500.
UNIQUE_ITEMS = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}

BAD_CHAT: list[tuple[str, dict[str, Any]]] = [
    ("max_tokens as a numeric string", {"max_tokens": "10"}),
    ("max_tokens as a bool", {"max_tokens": True}),
    ("temperature as a string", {"temperature": "0.5"}),
    ("top_p as a bool", {"top_p": True}),
    ("seed as a float", {"seed": 1.5}),
    ("n as a string", {"n": "2"}),
    ("stop string over the cap", {"stop": "x" * 257}),
    ("stop list with a long string", {"stop": ["ok", "y" * 1000]}),
    ("stream_options flag as a string", {"stream": True, "stream_options": {"include_usage": "yes"}}),
    ("n above BUNDLE_MAX_N", {"n": 9}),
    ("top_logprobs above 20", {"logprobs": True, "top_logprobs": 21}),
    ("top_logprobs without logprobs", {"top_logprobs": 2}),
    ("logprobs as an int on chat", {"logprobs": 3}),
    ("logit_bias id out of range", {"logit_bias": {"5000": 1.0}}),
    ("logit_bias key not an id", {"logit_bias": {"hello": 1.0}}),
    ("logit_bias value out of range", {"logit_bias": {"5": 101}}),
    ("stop_token_ids out of range", {"stop_token_ids": [99999]}),
    ("repetition_penalty zero", {"repetition_penalty": 0}),
    ("min_p above one", {"min_p": 1.5}),
    ("image part", user([{"type": "image_url", "image_url": {"url": "x"}}])),
    ("audio part", user([{"type": "input_audio", "input_audio": {}}])),
    ("unknown part type", user([{"type": "hologram", "text": "x"}])),
    ("tool message without tool_call_id", {"messages": [{"role": "tool", "content": "x"}]}),
    ("tool_calls on a user message", {"messages": [{"role": "user", "content": "x", "tool_calls": []}]}),
    ("tool_choice names an unknown function", {"tools": TOOLS, "tool_choice": UNKNOWN_CHOICE}),
    ("tool_choice required without tools", {"tool_choice": "required"}),
    ("tool without function", {"tools": [{"type": "function"}]}),
    ("duplicate tool names", {"tools": [TOOLS[0], TOOLS[0]]}),
    ("invalid tool parameters schema", one_tool({"type": "nope"})),
    ("invalid response_format schema", schema_format({"type": 5})),
    ("schema the grammar backend cannot compile", schema_format(UNIQUE_ITEMS)),
    ("forced call the grammar backend cannot compile", {**one_tool(UNIQUE_ITEMS), "tool_choice": "required"}),
    ("json_schema type without a schema", {"response_format": {"type": "json_schema"}}),
    ("unknown response_format type", {"response_format": {"type": "yaml"}}),
    ("forced call and json mode", {"tools": TOOLS, "tool_choice": "required", "response_format": JSON_MODE}),
]  # fmt: skip


@pytest.mark.parametrize("name,change", BAD_CHAT, ids=[name for name, _ in BAD_CHAT])
def test_bad_chat_input_is_a_400_that_never_reaches_the_engine(
    http: httpx.Client, service: Service, name: str, change: dict[str, Any]
) -> None:
    before = generations(service)
    response = http.post(
        "/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 4, **change}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert generations(service) == before


@pytest.mark.parametrize(
    "change", [{"logprobs": 6}, {"logprobs": True}, {"max_tokens": "4"}, {"prompt": [1, "2"]}]
)
def test_bad_completion_input_is_a_400(http: httpx.Client, service: Service, change: dict[str, Any]) -> None:
    before = generations(service)
    response = http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 4, **change})
    assert response.status_code == 400, response.text
    assert generations(service) == before


# --- the Cog runner's inputs (no server: the translation only) ---------------------------------
def test_cog_json_schema_and_tools_inputs_become_the_same_request() -> None:
    from cog_inputs import chat_request_from_inputs

    from shared.errors import InvalidRequest
    from shared.settings import Settings

    settings = Settings()
    body = chat_request_from_inputs(
        settings, prompt="hi", json_schema=json.dumps(WEATHER), tools=json.dumps(TOOLS[:1]), max_tokens=4
    )
    assert body.response_format is not None and body.response_format.json_schema is not None
    assert body.response_format.json_schema.schema_ == WEATHER
    assert [t.function.name for t in body.tools or []] == ["get_weather"]
    with pytest.raises(InvalidRequest, match="json_schema"):
        chat_request_from_inputs(settings, prompt="hi", json_schema="{not json")
    with pytest.raises(InvalidRequest):
        chat_request_from_inputs(settings, prompt="hi", tools='[{"type": "function"}]')
