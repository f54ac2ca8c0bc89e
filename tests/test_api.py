"""The OpenAI-compatible API on the REAL vLLM engine (CPU build, tiny model), driven by the
official `openai` SDK and by raw HTTP where the SDK hides what is being checked."""

from __future__ import annotations

import gc
import json
import time
import uuid
from typing import Any

import httpx
import openai
import orjson
import pytest
from vllm.benchmarks.lib.endpoint_request_func import StreamedResponseHandler

from shared.service import Service
from tests.conftest import LiveServers, long_chat, wait_until
from tests.gate import Gate

MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.fixture
def sdk(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def sse_events(raw: bytes) -> list[tuple[int | None, bytes]]:
    """(id, data) of every event of a raw SSE body; id None for an event without one."""
    events = []
    for block in raw.split(b"\n\n"):
        if not block.strip():
            continue
        fields = dict(line.split(b": ", 1) for line in block.split(b"\n"))
        event_id = fields.get(b"id")
        events.append((None if event_id is None else int(event_id), fields[b"data"]))
    return events


def test_sdk_streams_chat(sdk: openai.OpenAI) -> None:
    stream = sdk.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=12, stream=True, temperature=0.0
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_sdk_chat_without_streaming_matches_greedy_stream(sdk: openai.OpenAI) -> None:
    whole = sdk.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0.0)
    stream = sdk.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=12, temperature=0.0, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert whole.choices[0].message.content == streamed
    assert whole.usage is not None and whole.usage.completion_tokens <= 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens


def test_sdk_completions_stream_and_not(sdk: openai.OpenAI) -> None:
    whole = sdk.completions.create(model="tiny", prompt="Once upon", max_tokens=10, temperature=0.0, seed=1)
    pieces = sdk.completions.create(
        model="tiny", prompt="Once upon", max_tokens=10, temperature=0.0, seed=1, stream=True
    )
    assert whole.choices[0].text == "".join(c.choices[0].text for c in pieces)
    assert whole.object == "text_completion"


def test_seed_makes_sampling_repeatable(sdk: openai.OpenAI) -> None:
    def sample() -> str | None:
        reply = sdk.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=16, temperature=1.0, top_p=0.9, seed=42
        )
        return reply.choices[0].message.content

    assert sample() == sample()


def test_include_usage_puts_usage_on_the_last_chunk(sdk: openai.OpenAI) -> None:
    chunks = list(
        sdk.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].choices == []
    assert all(c.usage is None for c in chunks[:-1])


def test_stop_sequence_is_honoured(sdk: openai.OpenAI) -> None:
    free = sdk.completions.create(model="tiny", prompt="a", max_tokens=30, temperature=0.0)
    text = free.choices[0].text
    # A character of the greedy text past its start: generation must end right before it.
    stop = next(c for c in text[3:] if c.strip())
    stopped = sdk.completions.create(model="tiny", prompt="a", max_tokens=30, temperature=0.0, stop=[stop])
    assert stopped.choices[0].text == text[: text.index(stop)], (text, stop)
    assert stopped.choices[0].finish_reason == "stop"


def test_event_ids_increase_by_one(http: httpx.Client) -> None:
    # Only a resumable stream read as SSE proper is numbered.
    headers = {"X-Request-Id": f"ids-{uuid.uuid4().hex}", "Accept": "text/event-stream"}
    raw = http.post("/v1/chat/completions", json=long_chat(max_tokens=20), headers=headers).content
    events = sse_events(raw)
    assert [event_id for event_id, _ in events] == list(range(1, len(events) + 1))
    assert events[-1][1] == b"[DONE]"


def read_as_vllm_bench(pieces: list[bytes]) -> list[Any]:
    """Every message of a stream, parsed exactly as `vllm bench serve` parses them (its handler
    on each piece as received, then `removeprefix("data: ")` and `json.loads`), "[DONE]" kept
    as is. Raises where vLLM's client would count the request as failed."""
    handler = StreamedResponseHandler()
    parsed: list[Any] = []
    for piece in pieces:
        piece = piece.strip()
        if not piece:
            continue
        for message in handler.add_chunk(piece):
            if message.startswith(":"):
                continue
            chunk = message.removeprefix("data: ")
            parsed.append(chunk if chunk == "[DONE]" else json.loads(chunk))
    return parsed


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/chat/completions", long_chat(max_tokens=20, stream_options={"include_usage": True})),
        (
            "/v1/completions",
            {"model": "tiny", "prompt": "Once", "max_tokens": 20, "ignore_eos": True, "stream": True},
        ),
    ],
)
def test_an_anonymous_stream_has_no_ids_and_reads_as_vllm_bench_reads_it(
    http: httpx.Client, path: str, body: dict[str, Any]
) -> None:
    with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        pieces = list(response.iter_raw())
    raw = b"".join(pieces)
    lines = raw.split(b"\n")
    assert not [line for line in lines if line.startswith(b"id:")]  # nobody can resume it
    events = sse_events(raw)
    parsed = read_as_vllm_bench(pieces)
    assert len(parsed) == len(events) and parsed[-1] == "[DONE]"  # every event read, none lost
    tokens = [c for c in parsed[:-1] if c["choices"] and c["choices"][0].get("finish_reason") is not None]
    assert len(tokens) == 1  # the last token chunk carries the finish reason
    if "stream_options" in body:
        assert parsed[-2]["usage"]["completion_tokens"] == 20


@pytest.mark.parametrize(
    "accept,numbered",
    [
        ("*/*", False),  # vLLM's bench client: it sends an X-Request-Id on every request
        ("application/json", False),  # the openai SDK
        ("text/*, */*;q=0.1", False),  # wildcards do not name SSE
        ("application/json, Text/Event-Stream;q=0.5", True),  # named: any case, any parameters
    ],
)
def test_an_identified_stream_is_numbered_only_when_sse_is_asked_for(
    http: httpx.Client, accept: str, numbered: bool
) -> None:
    headers = {"X-Request-Id": f"accept-{uuid.uuid4().hex}", "Accept": accept}
    body = long_chat(max_tokens=12)
    with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
        assert response.status_code == 200
        pieces = list(response.iter_raw())
    events = sse_events(b"".join(pieces))
    assert events[-1][1] == b"[DONE]"
    if numbered:
        assert [event_id for event_id, _ in events] == list(range(1, len(events) + 1))
    else:
        assert all(event_id is None for event_id, _ in events)
        parsed = read_as_vllm_bench(pieces)
        assert len(parsed) == len(events) and parsed[-1] == "[DONE]"


def test_models_and_health(http: httpx.Client) -> None:
    assert http.get("/health").json() == {"status": "ok"}
    models = http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]


def test_disconnect_aborts_engine_request(base_url: str, service: Service, gate: Gate) -> None:
    disconnects = service.metrics.aborted_requests.labels("disconnect")
    before = disconnects._value.get()
    # Frozen in the engine after 8 deltas: only the abort can end the request.
    with gate.hold(after=8, freeze_engine=True) as held:
        with httpx.Client(base_url=base_url, timeout=30) as client:
            body = long_chat(messages=[{"role": "user", "content": held.prompt("tell me a long story")}])
            with client.stream("POST", "/v1/chat/completions", json=body) as response:
                lines = response.iter_lines()
                for _ in range(6):
                    next(lines)
                held.wait_held()
                assert service.engine.running_requests() >= 1
        # Leaving the block closed the connection mid-stream: the abort is counted as a
        # disconnect (not a finish), and the engine lets go (the bound only stops a hang).
        wait_until(lambda: service.engine.running_requests() == 0, timeout=60.0)
    assert disconnects._value.get() == before + 1
    metrics = httpx.get(f"{base_url}/metrics").text
    assert "bundle_active_streams 0.0" in metrics


def test_gauges_are_live_right_after_a_stream(http: httpx.Client) -> None:
    http.post("/v1/chat/completions", json=long_chat(max_tokens=5)).read()
    metrics = http.get("/metrics").text
    assert "bundle_active_streams 0.0" in metrics
    assert "bundle_running_generations 0.0" in metrics
    assert "bundle_engine_running_requests 0.0" in metrics
    assert "bundle_time_to_first_token_seconds_count" in metrics


def _engine_output_tallies(http: httpx.Client) -> dict[str, float]:
    prefix = "bundle_engine_output_"
    lines = http.get("/metrics").text.splitlines()
    return {
        name: float(value)
        for name, _, value in (line.partition(" ") for line in lines)
        if name.startswith(prefix)
    }


def test_the_engines_step_outputs_are_timed_from_vllms_own_stamp(http: httpx.Client) -> None:
    """shared/obs/engine_outputs.py: every step's outputs, from the engine core's stamp to the API
    process taking them up, and how long handing them out took (the real engine, 8 tokens)."""
    before = _engine_output_tallies(http)
    http.post("/v1/completions", json={"model": "tiny", "prompt": "a b c", "max_tokens": 8}).read()
    after = _engine_output_tallies(http)
    steps = after["bundle_engine_output_wait_seconds_count"] - before["bundle_engine_output_wait_seconds_count"]
    assert steps >= 8  # one per token at least: each step's outputs are taken up once
    waited = after["bundle_engine_output_wait_seconds_sum"] - before["bundle_engine_output_wait_seconds_sum"]
    assert 0.0 <= waited / steps < 5.0  # the same clock in both processes: no negative or absurd waits
    handled = (
        after["bundle_engine_output_handling_seconds_count"]
        - before["bundle_engine_output_handling_seconds_count"]
    )
    assert handled >= steps - 1


BAD_INPUTS: list[tuple[str, dict | bytes]] = [
    ("negative max_tokens", {"max_tokens": -1}),
    ("zero max_tokens", {"max_tokens": 0}),
    ("huge max_tokens", {"max_tokens": 10**9}),
    ("max_tokens as string", {"max_tokens": "ten"}),
    ("temperature too high", {"temperature": 3.5}),
    ("top_p zero", {"top_p": 0}),
    ("stream not a bool", {"stream": "yes"}),
    ("messages empty", {"messages": []}),
    ("messages not a list", {"messages": "hello"}),
    ("message without content", {"messages": [{"role": "user"}]}),
    ("unknown role", {"messages": [{"role": "wizard", "content": "x"}]}),
    ("unknown model", {"model": "gpt-17"}),
    ("logprobs not a bool", {"logprobs": "yes"}),
    ("unsupported tools", {"tools": [{"type": "function"}]}),
    ("n above BUNDLE_MAX_N", {"n": 9}),
    ("too many stops", {"stop": ["a", "b", "c", "d", "e"]}),
    ("prompt too long", {"messages": [{"role": "user", "content": "word " * 9000}]}),
    ("malformed JSON", b'{"model": "tiny", "messages": ['),
    ("JSON not an object", b'["model", "tiny"]'),
    ("oversized body", b'{"model": "tiny", "pad": "' + b"x" * 2_000_000 + b'"}'),
]


@pytest.mark.parametrize("name,change", BAD_INPUTS, ids=[name for name, _ in BAD_INPUTS])
def test_bad_input_is_a_4xx_openai_error_that_never_reaches_the_engine(
    http: httpx.Client, service: Service, name: str, change: dict | bytes
) -> None:
    before = service.metrics.engine_generations._value.get()
    if isinstance(change, bytes):
        response = http.post(
            "/v1/chat/completions", content=change, headers={"content-type": "application/json"}
        )
    else:
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, **change}
        response = http.post("/v1/chat/completions", json=body)
    assert 400 <= response.status_code < 500, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert service.metrics.engine_generations._value.get() == before


def test_sdk_raises_its_own_error_types(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=-3)
    assert bad.value.body["param"] == "max_tokens"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(model="nope", messages=MESSAGES)


def test_api_key_is_required_everywhere_but_health(live: LiveServers) -> None:
    url, _ = live.serve(api_key="s3cret")
    routes = [
        ("GET", "/v1/models", None),
        ("GET", "/metrics", None),
        ("POST", "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 2}),
        ("POST", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2}),
        ("POST", "/v1/requests/abc/cancel", None),
        ("GET", "/no/such/route", None),
    ]
    with httpx.Client(base_url=url, timeout=30) as client:
        assert client.get("/health").status_code == 200
        for method, path, body in routes:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                response = client.request(method, path, json=body, headers=headers)
                assert response.status_code == 401, (path, headers)
                assert response.json()["error"]["type"] == "authentication_error"
            good = client.request(method, path, json=body, headers={"Authorization": "Bearer s3cret"})
            assert good.status_code != 401
    sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0)
    assert sdk.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3).choices
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()


def test_requests_beyond_the_in_flight_cap_get_429(live: LiveServers, gate: Gate) -> None:
    url, service = live.serve(max_in_flight=2, retry_after_s=3)
    # Both held after a delta: they fill the cap until the block ends, however fast the engine.
    with gate.hold(after=1) as held, httpx.Client(base_url=url, timeout=30) as client:
        body = long_chat(messages=[{"role": "user", "content": held.prompt("tell me a long story")}])
        with (
            client.stream("POST", "/v1/chat/completions", json=body) as first,
            client.stream("POST", "/v1/chat/completions", json=body) as second,
        ):
            # Keep both line iterators referenced: a discarded one closes its connection,
            # which (rightly) aborts that anonymous generation.
            lines = (first.iter_lines(), second.iter_lines())
            next(lines[0]), next(lines[1])
            held.wait_held(count=2)
            refused = client.post("/v1/chat/completions", json=long_chat(max_tokens=2))
            assert refused.status_code == 429
            assert refused.headers["retry-after"] == "3"
            assert refused.json()["error"]["type"] == "rate_limit_error"
    wait_until(lambda: service.engine.running_requests() == 0, timeout=60.0)
    with httpx.Client(base_url=url, timeout=30) as client:
        assert client.post("/v1/chat/completions", json=long_chat(max_tokens=2)).status_code == 200


def test_engine_start_freezes_the_startup_heap(live: LiveServers) -> None:
    # Unfrozen, each full collection walks torch's and vLLM's ~600k objects and stalls every
    # stream on the loop for ~0.4 s on this box; frozen, it walks only what serving made.
    frozen = gc.get_freeze_count()
    assert frozen > 100_000
    assert len(gc.get_objects()) < frozen


def test_unknown_route_gets_openai_error_json(http: httpx.Client) -> None:
    response = http.get("/v1/nothing-here")
    assert response.status_code == 404
    assert response.json()["error"]["message"]


def test_a_burst_of_concurrent_streams_all_complete(base_url: str, service: Service) -> None:
    import asyncio

    async def one(client: httpx.AsyncClient) -> int:
        response = await client.post(
            "/v1/completions",
            json={
                "model": "tiny",
                "prompt": "x",
                "max_tokens": 32,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        usage_event = sse_events(response.content)[-2][1]
        return int(orjson.loads(usage_event)["usage"]["completion_tokens"])

    async def burst() -> list[int]:
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
            return await asyncio.gather(*(one(client) for _ in range(32)))

    started = time.perf_counter()
    counts = asyncio.run(burst())
    assert counts == [32] * 32
    assert time.perf_counter() - started < 60  # orders of magnitude above the ~0.2 s it takes
