"""Hostile input: every case is a 4xx with OpenAI error JSON and none reaches the engine; a fuzz
test finds no 5xx. The bulk runs in-process (`httpx.ASGITransport`) on the scripted engine, for
speed; the HTTP-layer bounds (head size and time) and a share of the fuzzing run over real HTTP,
the latter against the real engine."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest
import uvicorn
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

from shared.http.api import create_app
from shared.http.limits import uvicorn_options
from shared.service import Service
from shared.settings import Settings
from tests.conftest import free_port, long_chat, wait_until
from tests.gate import Gate
from tests.scripted import ScriptedEngine, settle

REMOVE = object()  # a field to leave out of the valid body
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
VALID_CHAT: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
VALID_COMPLETION: dict[str, Any] = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
API_KEY = "s3cret"


@dataclass
class Case:
    name: str
    change: dict[str, Any] | bytes = field(default_factory=dict)  # merged into the valid body, or raw
    path: str = CHAT
    method: str = "POST"
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    content_type: bytes | None = b"application/json"
    status: int | None = None  # a specific 4xx, when one is meant


def _body(case: Case) -> bytes | None:
    if case.method != "POST" or case.path.endswith("/cancel"):
        return None
    if isinstance(case.change, bytes):
        return case.change
    base = VALID_COMPLETION if case.path == COMPLETIONS else VALID_CHAT
    merged = {**base, **case.change}
    return _dumps({key: value for key, value in merged.items() if value is not REMOVE})


def _dumps(value: Any) -> bytes:
    # The standard library's encoder: it also writes integers beyond 64 bits (orjson refuses).
    return json.dumps(value).encode()


def _headers(case: Case) -> list[tuple[bytes, bytes]]:
    headers = list(case.headers)
    if case.content_type is not None and _body(case) is not None:
        headers.append((b"content-type", case.content_type))
    return headers


# --- the cases --------------------------------------------------------------------------------
def _resume(value: bytes, name: str) -> Case:
    return Case(f"Last-Event-ID {name}", headers=[(b"x-request-id", b"resume-me"), (b"last-event-id", value)])


LAST_EVENT_IDS = [
    _resume("²".encode(), "superscript two (utf-8)"),
    _resume("²".encode("latin-1"), "superscript two (latin-1)"),
    _resume("¹²".encode(), "superscript digits"),
    _resume("٣".encode(), "arabic-indic digit"),
    _resume("３".encode(), "fullwidth digit"),
    _resume("߀".encode(), "nko digit"),
    _resume("𝟘".encode(), "mathematical digit"),
    _resume("1²".encode(), "digit then superscript"),
    _resume(b"9" * 5000, "of 5,000 digits"),
    _resume(b"9" * 19, "of 19 digits"),
    _resume(b"1" * 64, "of 64 digits"),
    _resume(b"-1", "negative"),
    _resume(b"+1", "with a plus sign"),
    _resume(b"1.5", "fractional"),
    _resume(b"1e3", "exponent"),
    _resume(b"0x1f", "hexadecimal"),
    _resume(b"abc", "letters"),
    _resume(b"1 2", "with a space inside"),
    _resume(b"1_000", "with an underscore"),
    Case("Last-Event-ID without X-Request-Id", headers=[(b"last-event-id", b"3")]),
    Case(
        "Last-Event-ID for an id never seen",
        headers=[(b"x-request-id", b"never-seen"), (b"last-event-id", b"3")],
        status=410,
    ),
]


def _named(value: bytes, name: str, status: int | None = None) -> Case:
    return Case(f"X-Request-Id {name}", headers=[(b"x-request-id", value)], status=status)


REQUEST_IDS = [
    _named(b"x" * 257, "of 257 characters"),
    _named(b"x" * 5000, "of 5,000 characters"),
    _named(b"x" * 1_048_576, "of 1 MiB", status=431),
    _named(b"a\x01b", "with a control character"),
    _named(b"a\tb", "with a tab"),
    _named(b"a\x7fb", "with DEL"),
    _named(b"a\x00b", "with NUL"),
    _named("é".encode("latin-1"), "non-ASCII (latin-1)"),
    _named("é".encode(), "non-ASCII (utf-8)"),
    _named("\u202eevil".encode(), "with a bidi override"),
    _named(b" lead", "with a leading space"),
    _named(b"trail ", "with a trailing space"),
    Case(
        "X-Request-Id given twice",
        headers=[(b"x-request-id", b"one"), (b"x-request-id", b"two")],
    ),
    Case(
        "Last-Event-ID given twice",
        headers=[(b"x-request-id", b"one"), (b"last-event-id", b"1"), (b"last-event-id", b"2")],
    ),
]


def _cancel(segment: str, name: str, status: int | None = None) -> Case:
    return Case(f"cancel id {name}", path=f"/v1/requests/{segment}/cancel", status=status)


CANCELS = [
    _cancel("x" * 300, "of 300 characters"),
    _cancel("x" * 5000, "of 5,000 characters"),
    _cancel("%00", "NUL"),
    _cancel("a%01b", "with a control character"),
    _cancel("%C3%A9", "non-ASCII"),
    _cancel("%7F", "DEL"),
    _cancel("%20lead", "with a leading space"),
    _cancel("a%09b", "with a tab"),
    _cancel("never-seen", "never seen", status=404),
    Case("cancel with GET", path="/v1/requests/abc/cancel", method="GET", status=405),
]

HEADER_FLOODS = [
    Case("101 headers", headers=[(b"x-pad-%d" % i, b"v") for i in range(101)], status=431),
    Case("1,000 headers", headers=[(b"x-pad-%d" % i, b"v") for i in range(1000)], status=431),
    Case("one 40 KB header", headers=[(b"x-pad", b"v" * 40_000)], status=431),
    Case("ten 4 KB headers", headers=[(b"x-pad-%d" % i, b"v" * 4000) for i in range(10)], status=431),
    Case("two content types", headers=[(b"content-type", b"text/plain")]),
]

CONTENT_TYPES = [
    None,
    b"",
    b"text/plain",
    b"text/plain; charset=utf-8",
    b"application/x-www-form-urlencoded",
    b"multipart/form-data; boundary=x",
    b"application/jsonx",
    b"application/json-seq",
    b"text/json",
    b"application/xml",
    b"*/*",
    b"application/javascript",
]
MEDIA_TYPES = [
    Case(f"content type {kind!r} on {path}", path=path, content_type=kind, status=415)
    for path in (CHAT, COMPLETIONS)
    for kind in CONTENT_TYPES
]

RAW_BODIES = [
    Case("empty body", b""),
    Case("truncated object", b'{"model": "tiny", "messages": ['),
    Case("lone brace", b"}"),
    Case("JSON null", b"null"),
    Case("JSON true", b"true"),
    Case("JSON number", b"1"),
    Case("JSON string", b'"tiny"'),
    Case("JSON array", b'["model", "tiny"]'),
    Case("trailing comma", b'{"model": "tiny",}'),
    Case("NaN literal", b'{"model": "tiny", "max_tokens": NaN}'),
    Case("invalid UTF-8", b'{"model": "\xff\xfe"}'),
    Case("UTF-16 bytes", '{"model": "tiny"}'.encode("utf-16")),
    Case("deep array nesting", b"[" * 100_000 + b"]" * 100_000, status=None),
    Case("deep object nesting", b'{"a":' * 5000 + b"1" + b"}" * 5000),
    Case("single quotes", b"{'model': 'tiny'}"),
    Case("trailing garbage", b'{"model": "tiny"} trailing'),
    Case("oversized body", b'{"model": "tiny", "pad": "' + b"x" * 2_000_000 + b'"}', status=413),
]


def _chat(name: str, **change: Any) -> Case:
    return Case(f"chat {name}", change)


def _completion(name: str, **change: Any) -> Case:
    return Case(f"completion {name}", change, path=COMPLETIONS)


SCHEMA = [
    _chat("negative max_tokens", max_tokens=-1),
    _chat("zero max_tokens", max_tokens=0),
    _chat("huge max_tokens", max_tokens=10**9),
    _chat("max_tokens as a word", max_tokens="ten"),
    _chat("max_tokens as a numeric string", max_tokens="10"),
    _chat("max_tokens as true", max_tokens=True),
    _chat("max_tokens fractional", max_tokens=10.5),
    _chat("max_tokens as a list", max_tokens=[4]),
    _chat("temperature too high", temperature=3.5),
    _chat("temperature negative", temperature=-0.1),
    _chat("temperature as a string", temperature="0.5"),
    _chat("temperature as true", temperature=True),
    _chat("top_p zero", top_p=0),
    _chat("top_p above one", top_p=1.5),
    _chat("top_p as a string", top_p="1"),
    _chat("seed negative", seed=-1),
    _chat("seed beyond 64 bits", seed=2**64),
    _chat("seed as a string", seed="1"),
    _chat("stream as a word", stream="yes"),
    _chat("stream as a string", stream="true"),
    _chat("stream as a number", stream=1),
    _chat("stream_options not an object", stream_options="x"),
    _chat("stream_options unknown key", stream_options={"bogus": 1}),
    _chat("include_usage as a string", stream=True, stream_options={"include_usage": "yes"}),
    _chat("five stops", stop=["a", "b", "c", "d", "e"]),
    _chat("empty stop", stop=""),
    _chat("empty stop in a list", stop=[""]),
    _chat("stop not a string", stop=[1]),
    _chat("stop an object", stop={"a": 1}),
    _chat("stop of 100 KB", stop="x" * 100_000),
    _chat("messages empty", messages=[]),
    _chat("messages a string", messages="hello"),
    _chat("messages missing", messages=REMOVE),
    _chat("message without content", messages=[{"role": "user"}]),
    _chat("message without role", messages=[{"content": "x"}]),
    _chat("unknown role", messages=[{"role": "wizard", "content": "x"}]),
    _chat("content a number", messages=[{"role": "user", "content": 5}]),
    _chat("message a number", messages=[1]),
    _chat("message with an unknown field", messages=[{"role": "user", "content": "x", "mood": "sad"}]),
    _chat("unknown model", model="gpt-17"),
    _chat("empty model", model=""),
    _chat("model a number", model=5),
    _chat("model missing", model=REMOVE),
    _chat("n above the limit", n=1000),
    _chat("n zero", n=0),
    _chat("presence_penalty too high", presence_penalty=3),
    _chat("frequency_penalty too low", frequency_penalty=-3),
    _chat("top_k below -1", top_k=-2),
    _chat("top_k as a string", top_k="5"),
    _chat("an unknown field", frobnicate=True),
    _chat("prompt too long in tokens", messages=[{"role": "user", "content": "word " * 9000}]),
    _chat("prompt too long in characters", messages=[{"role": "user", "content": "x" * 300_000}]),
    _completion("prompt missing", prompt=REMOVE),
    _completion("prompt empty list", prompt=[]),
    _completion("prompt negative token", prompt=[-1]),
    _completion("prompt token outside the vocabulary", prompt=[10**6]),
    _completion("prompt list of strings", prompt=["a"]),
    _completion("prompt nested lists", prompt=[[1]]),
    _completion("prompt a number", prompt=5),
    _completion("prompt of 9,000 token ids", prompt=[1] * 9000),
    _completion("prompt too long in characters", prompt="x" * 300_000),
    _completion("echo", echo=True),
    _completion("suffix", suffix="x"),
    _completion("max_tokens as a string", max_tokens="4"),
]

ROUTES = [
    Case("GET on chat", method="GET", status=405),
    Case("PUT on chat", method="PUT", status=405),
    Case("DELETE on completions", path=COMPLETIONS, method="DELETE", status=405),
    Case("POST on models", path="/v1/models", status=405),
    Case("unknown route", path="/v1/nothing-here", method="GET", status=404),
    Case("unknown POST route", path="/v1/embeddings", status=404),
]

HOSTILE = LAST_EVENT_IDS + REQUEST_IDS + CANCELS + HEADER_FLOODS + MEDIA_TYPES + RAW_BODIES + SCHEMA + ROUTES

BAD_CREDENTIALS = [
    None,
    b"Bearer wrong",
    b"Basic czNjcmV0",
    b"bearer",
    b"Bearer",
    b"Bearer ",
    b"Token " + API_KEY.encode(),
    API_KEY.encode(),
    b"Bearer" + API_KEY.encode(),
    b"Bearer " + API_KEY.encode() + b" extra",
    b"Bearer " + API_KEY.upper().encode(),
    "Bearer sécret".encode(),
]


def test_the_suite_is_large() -> None:
    assert len(HOSTILE) + len(BAD_CREDENTIALS) >= 100
    assert len({case.name for case in HOSTILE}) == len(HOSTILE)


# --- in-process app on the scripted engine ---------------------------------------------------
@dataclass
class App:
    client: httpx.AsyncClient
    engine: ScriptedEngine
    service: Service


@pytest.fixture(scope="module")
async def scripted() -> AsyncIterator[App]:
    async with _scripted_app(Settings()) as app:
        yield app


@pytest.fixture(scope="module")
async def keyed() -> AsyncIterator[App]:
    async with _scripted_app(Settings(api_key=API_KEY)) as app:
        yield app


class _scripted_app:  # noqa: N801 - used as an async context manager, named like one
    def __init__(self, settings: Settings) -> None:
        self.engine = ScriptedEngine(auto=True)
        self.app = create_app(settings, engine=self.engine)
        self._lifespan = self.app.router.lifespan_context(self.app)

    async def __aenter__(self) -> App:
        await self._lifespan.__aenter__()
        transport = httpx.ASGITransport(app=self.app)
        self.client = httpx.AsyncClient(transport=transport, base_url="http://bundle", timeout=30)
        return App(self.client, self.engine, self.app.state.service)

    async def __aexit__(self, *exc: object) -> None:
        await self.client.aclose()
        await self._lifespan.__aexit__(None, None, None)


def _generations(service: Service) -> float:
    return service.metrics.engine_generations._value.get()


def _assert_openai_error(response: httpx.Response, status: int | None) -> None:
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    if status is not None:
        assert response.status_code == status, response.text[:300]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]


@pytest.mark.parametrize("case", HOSTILE, ids=[case.name for case in HOSTILE])
async def test_hostile_request_is_a_4xx_openai_error_that_never_reaches_the_engine(
    scripted: App, case: Case
) -> None:
    started, generations = len(scripted.engine.started), _generations(scripted.service)
    response = await scripted.client.request(
        case.method, case.path, content=_body(case), headers=_headers(case)
    )
    _assert_openai_error(response, case.status)
    assert len(scripted.engine.started) == started
    assert _generations(scripted.service) == generations


@pytest.mark.parametrize("credential", BAD_CREDENTIALS, ids=[repr(c) for c in BAD_CREDENTIALS])
async def test_bad_credentials_are_401_and_never_reach_the_engine(keyed: App, credential: bytes | None) -> None:
    headers = [(b"content-type", b"application/json")]
    if credential is not None:
        headers.append((b"authorization", credential))
    started = len(keyed.engine.started)
    response = await keyed.client.post(CHAT, content=orjson.dumps(VALID_CHAT), headers=headers)
    _assert_openai_error(response, 401)
    assert response.json()["error"]["type"] == "authentication_error"
    assert len(keyed.engine.started) == started


@pytest.mark.parametrize("scheme", [b"Bearer", b"bearer", b"BEARER", b"bEaReR"])
async def test_the_bearer_scheme_is_case_insensitive(keyed: App, scheme: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"authorization", scheme + b" " + API_KEY.encode())]
    response = await keyed.client.post(CHAT, content=orjson.dumps(VALID_CHAT), headers=headers)
    assert response.status_code == 200, response.text


async def test_the_header_guard_answers_before_auth(keyed: App) -> None:
    # A flood of headers without a key: refused for its size, not asked for credentials.
    response = await keyed.client.get("/v1/models", headers=[(b"x-pad", b"v" * 40_000)])
    assert response.status_code == 431


async def test_a_valid_request_id_of_the_maximum_length_is_served_and_echoed(scripted: App) -> None:
    request_id = "a" * 256
    response = await scripted.client.post(CHAT, json=VALID_CHAT, headers={"X-Request-Id": request_id})
    assert response.status_code == 200
    assert response.headers["x-request-id"] == request_id


async def test_last_event_id_past_the_live_end_of_a_running_stream_is_400() -> None:
    async with _scripted_app(Settings()) as app:
        app.engine.auto = False  # tokens only when the test says so: the stream stays running
        body = {**VALID_CHAT, "stream": True, "max_tokens": 50}
        headers = {"X-Request-Id": "running"}
        first = asyncio.create_task(app.client.post(CHAT, json=body, headers=headers))
        await settle()
        app.engine.step(2)
        await settle()
        attached = app.service.metrics.replayed_requests._value.get()
        ahead = await app.client.post(CHAT, json=body, headers={**headers, "Last-Event-ID": "40"})
        _assert_openai_error(ahead, 400)
        assert ahead.json()["error"]["param"] == "Last-Event-ID"
        assert app.service.metrics.replayed_requests._value.get() == attached  # refused: no attach
        app.engine.step(50)
        assert (await first).status_code == 200


async def test_a_cancelled_whole_answer_counts_as_aborted_not_as_refused() -> None:
    async with _scripted_app(Settings()) as app:
        app.engine.auto = False
        metrics = app.service.metrics
        waiting = asyncio.create_task(
            app.client.post(CHAT, json={**VALID_CHAT, "max_tokens": 50}, headers={"X-Request-Id": "whole"})
        )
        await settle()
        assert (await app.client.post("/v1/requests/whole/cancel")).json()["status"] == "cancelled"
        answer = await waiting
        assert answer.status_code == 499 and answer.json()["error"]["code"] == "request_cancelled"
        assert metrics.aborted_requests.labels("cancelled")._value.get() == 1
        assert metrics.rejected_requests.labels("499")._value.get() == 0  # it reached the engine


# --- fuzzing -----------------------------------------------------------------------------------
JSON_SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
# Flat on purpose: nested (recursive) strategies cost hypothesis more time to draw than the app
# takes to answer, and the schema's depth is one or two levels anyway.
JSON_VALUES = (
    JSON_SCALARS
    | st.lists(JSON_SCALARS, max_size=3)
    | st.dictionaries(st.sampled_from(["role", "content", "include_usage", "x"]), JSON_SCALARS, max_size=3)
    | st.lists(st.fixed_dictionaries({"role": JSON_SCALARS, "content": JSON_SCALARS}), max_size=2)
)
FIELDS = st.sampled_from(
    ["model", "messages", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "stream",
     "stream_options", "n", "top_k", "presence_penalty", "user", "ignore_eos", "max_completion_tokens"]
)  # fmt: skip
BODIES = st.one_of(
    st.dictionaries(FIELDS, JSON_VALUES, max_size=6).map(lambda change: {**VALID_CHAT, **change}),
    st.dictionaries(FIELDS, JSON_VALUES, max_size=6).map(lambda change: {**VALID_COMPLETION, **change}),
    JSON_VALUES,
).map(_dumps) | st.binary(max_size=200)
HEADER_VALUES = st.binary(max_size=40) | st.text(max_size=30).map(str.encode) | st.integers().map(b"%d".__mod__)
HEADERS = st.lists(
    st.tuples(
        st.sampled_from([b"x-request-id", b"last-event-id", b"content-type", b"authorization", b"x-other"]),
        HEADER_VALUES,
    ),
    max_size=4,
)
PATHS = st.sampled_from([CHAT, COMPLETIONS, "/v1/requests/abc/cancel", "/v1/models", "/health", "/metrics"])


def _safe_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    # Bytes a real HTTP client cannot send at all (line breaks, NUL) are the parser's business.
    return [(name, value.translate(None, b"\r\n\x00")) for name, value in headers]


FUZZ_EXAMPLES = 2000
fuzz_counter = {"requests": 0}


@pytest.mark.slow
@settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(path=PATHS, body=BODIES, headers=HEADERS, json_type=st.booleans())
async def test_fuzz_in_process_never_5xx(
    scripted: App, path: str, body: bytes, headers: list[tuple[bytes, bytes]], json_type: bool
) -> None:
    headers = _safe_headers(headers)
    if json_type:
        headers.append((b"content-type", b"application/json"))
    method = "GET" if path in ("/v1/models", "/health", "/metrics") else "POST"
    response = await scripted.client.request(method, path, content=body, headers=headers)
    fuzz_counter["requests"] += 1
    assert response.status_code < 500, (response.status_code, response.text[:300])
    if response.status_code >= 400:
        assert response.json()["error"]["message"]


@pytest.mark.slow
def test_the_fuzzer_sent_its_requests() -> None:
    # Runs after the fuzz test in file order; without it, a skipped fuzz test would pass silently.
    assert fuzz_counter["requests"] >= FUZZ_EXAMPLES


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(body=BODIES, headers=HEADERS)
def test_fuzz_over_real_http_on_the_real_engine_never_5xx(
    base_url: str, body: bytes, headers: list[tuple[bytes, bytes]]
) -> None:
    headers = [*_safe_headers(headers), (b"content-type", b"application/json")]
    with httpx.Client(base_url=base_url, timeout=60) as client:
        try:
            response = client.post(CHAT, content=body, headers=headers)
        except httpx.LocalProtocolError:
            reject()  # a header value the client itself refuses to send (e.g. leading space)
    assert response.status_code < 500, (response.status_code, response.text[:300])


# --- the HTTP layer: a real uvicorn with the bundle's protocol ---------------------------------
# The fixture's head bound: short to test quickly, yet several times the pauses the tests make
# between the parts of a request that must get through. A cut is timed between it and the
# default bound (which a server that ignored the setting would use): never near either.
HEAD_TIMEOUT_S = 2.0
DEFAULT_HEAD_TIMEOUT_S = Settings().header_timeout_s  # 10 s
TIMER_SLACK_S = 0.05  # asyncio may run a timer up to its clock's resolution early
CLIENT_TIMEOUT_S = 30.0  # above the default bound: a cut at it is seen, and timed, not a timeout


@pytest.fixture(scope="module")
def bounded_server() -> Iterator[tuple[str, int]]:
    """The scripted app under uvicorn with `uvicorn_options` (small bounds to test quickly)."""
    settings_ = Settings(api_key=API_KEY, header_timeout_s=HEAD_TIMEOUT_S, max_header_bytes=8192)
    app = create_app(settings_, engine=ScriptedEngine(auto=True))
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **uvicorn_options(settings_))
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield "127.0.0.1", port
    server.should_exit = True
    thread.join(timeout=10)


def _raw_exchange(address: tuple[str, int], chunks: list[bytes], pause_s: float = 0.0) -> bytes:
    with socket.create_connection(address, timeout=CLIENT_TIMEOUT_S) as sock:
        try:
            for chunk in chunks:
                sock.sendall(chunk)
                time.sleep(pause_s)
        except OSError:
            pass  # the server may close before everything is sent: that is the point
        received = b""
        while True:
            try:
                data = sock.recv(65536)
            except OSError:
                break
            if not data:
                break
            received += data
        return received


def _sent_until_cut(address: tuple[str, int], chunks: list[bytes], pause_s: float = 0.0) -> tuple[int, bytes]:
    """Send `chunks` until the server cuts the connection: (bytes sent, its reply)."""
    sent = 0
    with socket.create_connection(address, timeout=10) as sock:
        with contextlib.suppress(OSError):  # the server closed before everything was sent
            for chunk in chunks:
                sock.sendall(chunk)
                sent += len(chunk)
                time.sleep(pause_s)
        received = b""
        with contextlib.suppress(OSError):
            while data := sock.recv(65536):
                received += data
    return sent, received


def test_a_64_mib_header_is_refused_with_431_before_auth(bounded_server: tuple[str, int]) -> None:
    head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Pad: "
    sent, reply = _sent_until_cut(bounded_server, [head] + [b"v" * 65536] * 1024)
    assert reply.startswith(b"HTTP/1.1 431"), reply[:200]
    assert b'"request_header_fields_too_large"' in reply
    # Refused at the 8 KB bound: the old parser read all 64 MiB (~6 s) before answering 401. What
    # got through is the bound plus the sockets' buffers, whatever the machine's speed.
    assert sent < 16 * 2**20


def test_a_trickling_head_is_cut_with_408(bounded_server: tuple[str, int]) -> None:
    head = b"GET /health HTTP/1.1\r\nHost: x\r\n"
    trickle = [head] + [b"X-Slow-%d: v\r\n" % i for i in range(300)]
    started = time.monotonic()
    reply = _raw_exchange(bounded_server, trickle, pause_s=0.1)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    _assert_cut_at_the_head_bound(time.monotonic() - started)  # not after the 30 s trickle


def _assert_cut_at_the_head_bound(elapsed_s: float) -> None:
    """Cut by the fixture's bound: not before it, and not at the default one."""
    assert HEAD_TIMEOUT_S - TIMER_SLACK_S <= elapsed_s < DEFAULT_HEAD_TIMEOUT_S, elapsed_s


def test_a_declared_body_that_never_comes_is_cut_with_408(bounded_server: tuple[str, int]) -> None:
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\n"
        b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"model"'
    )
    started = time.monotonic()
    reply = _raw_exchange(bounded_server, [head])  # 9 of the 100 bytes, then silence
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"body not received" in reply
    _assert_cut_at_the_head_bound(time.monotonic() - started)


def test_a_connection_that_sends_nothing_is_closed(bounded_server: tuple[str, int]) -> None:
    started = time.monotonic()
    reply = _raw_exchange(bounded_server, [])
    assert reply.startswith(b"HTTP/1.1 408")
    _assert_cut_at_the_head_bound(time.monotonic() - started)


def test_a_body_larger_than_the_head_bound_still_passes(bounded_server: tuple[str, int]) -> None:
    # The head bound must not count the body when both arrive in one read.
    body = orjson.dumps({**VALID_CHAT, "user": "u" * 50_000})
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: bearer s3cret\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
    )
    reply = _raw_exchange(bounded_server, [head + body])
    assert reply.startswith(b"HTTP/1.1 200"), reply[:300]


def test_admission_is_timed_from_the_first_byte_read(bounded_server: tuple[str, int]) -> None:
    """bundle_admission_seconds starts when the protocol reads a request's first byte, not when
    its task first runs: a head that arrives in two parts 0.5 s apart is admitted well after it
    began (the time a busy loop keeps a request waiting is counted the same way). Timed from the
    task's start it would count ~0 s; half the pause is the bound, as the server's first read may
    come a little later than the client's send (0.2993 s was measured for a 0.3 s pause). The
    pause stays well under the fixture's head timeout (HEAD_TIMEOUT_S)."""

    def admissions() -> tuple[float, float]:
        with httpx.Client(base_url=f"http://{bounded_server[0]}:{bounded_server[1]}", timeout=10) as client:
            text = client.get("/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
        values = dict(
            line.split(" ") for line in text.splitlines() if line.startswith("bundle_admission_seconds_")
        )
        return float(values["bundle_admission_seconds_sum"]), float(values["bundle_admission_seconds_count"])

    body = orjson.dumps(VALID_CHAT)
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
    )
    seconds_before, count_before = admissions()
    reply = _raw_exchange(bounded_server, [head[:24], head[24:] + body], pause_s=0.5)
    assert reply.startswith(b"HTTP/1.1 200"), reply[:300]
    seconds, count = admissions()
    assert count == count_before + 1
    assert 0.25 <= seconds - seconds_before < 10


def _chat_head(body: bytes, *extra: bytes) -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body) + b"".join(extra) + b"\r\n"
    )


def test_a_body_that_arrives_after_its_head_is_read_whole(bounded_server: tuple[str, int]) -> None:
    """A small request's task starts when its body is complete (shared/http/limits.py): a body
    sent 0.3 s after the head, in two parts, is still read whole."""
    body = orjson.dumps(VALID_CHAT)
    head = _chat_head(body, b"Connection: close\r\n")
    reply = _raw_exchange(bounded_server, [head, body[:10], body[10:]], pause_s=0.3)
    assert reply.startswith(b"HTTP/1.1 200"), reply[:300]
    assert b"[DONE]" in reply or b'"choices"' in reply


def test_a_client_that_waits_for_100_continue_gets_it_and_its_answer(bounded_server: tuple[str, int]) -> None:
    """Expect: 100-continue: the body comes only after the server's 100, so its task must not
    wait for the body first."""
    body = orjson.dumps(VALID_CHAT)
    with socket.create_connection(bounded_server, timeout=10) as sock:
        sock.sendall(_chat_head(body, b"Expect: 100-continue\r\n", b"Connection: close\r\n"))
        assert sock.recv(65536).startswith(b"HTTP/1.1 100")
        sock.sendall(body)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 200"), reply[:300]


def test_pipelined_and_chunked_requests_are_answered_in_order(bounded_server: tuple[str, int]) -> None:
    body = orjson.dumps({**VALID_CHAT, "max_tokens": 2})
    chunked = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\n"
        b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        + b"%x\r\n%s\r\n0\r\n\r\n"
        % (len(body), body)
    )
    # Three requests in one write: a health check, a sized chat and a chunked chat.
    reply = _raw_exchange(
        bounded_server, [b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" + _chat_head(body) + body + chunked]
    )
    assert reply.count(b"HTTP/1.1 200") == 3, reply[:600]
    assert reply.index(b'{"status":"ok"}') < reply.index(b'"choices"')


def test_a_connection_lost_mid_body_leaves_the_server_serving(bounded_server: tuple[str, int]) -> None:
    body = orjson.dumps(VALID_CHAT)
    with socket.create_connection(bounded_server, timeout=10) as sock:
        sock.sendall(_chat_head(body) + body[:5])  # and gone
    with httpx.Client(base_url=f"http://{bounded_server[0]}:{bounded_server[1]}", timeout=10) as client:
        assert client.get("/health").status_code == 200
        reply = client.post(
            "/v1/chat/completions", json=VALID_CHAT, headers={"Authorization": f"Bearer {API_KEY}"}
        )
        assert reply.status_code == 200, reply.text


def test_keep_alive_requests_are_each_bounded(bounded_server: tuple[str, int]) -> None:
    with httpx.Client(base_url=f"http://{bounded_server[0]}:{bounded_server[1]}", timeout=10) as client:
        for _ in range(3):
            assert client.get("/health").status_code == 200
        assert client.get("/health", headers={"x-pad": "v" * 9000}).status_code == 431


# --- the real engine over real HTTP: loop stalls and leaving clients ----------------------------
# Sends the oversized prompts from a process of its own: the server under test runs in this
# process (tests/conftest.py, LiveServers), and a dozen client threads building and sending 7.5 MB
# here would hold the GIL against its event loop and time the test harness, not the server.
OVERSIZED_SENDER = """
import sys, concurrent.futures, httpx, orjson
url, body = sys.argv[1], orjson.loads(sys.argv[2])
def send(chars):
    text = ("word " * (chars // 5 + 1))[:chars]
    message = {**body, "messages": [{"role": "user", "content": text}]}
    with httpx.Client(base_url=url, timeout=120) as client:
        return client.post("/v1/chat/completions", json=message).status_code
with concurrent.futures.ThreadPoolExecutor(max_workers=12) as pool:
    print(list(pool.map(send, [1_000_000] * 6 + [250_000] * 6)))
"""


def test_huge_prompts_are_refused_without_stalling_a_running_stream(base_url: str) -> None:
    """While one stream runs, a dozen oversized prompts arrive at once: 1 MB ones (refused by
    the character bound before tokenising) and 250 KB ones (within it, so tokenised, then refused
    for their token count). Tokenising on the event loop held it ~1 s per MB (issue 18)."""
    import subprocess
    import sys

    stamps: list[float] = []
    done = threading.Event()

    def follow() -> None:
        # One stream after another until the test is done: tokens flow through the whole window
        # however fast the engine finishes a stream (a gap between two counts like any other).
        with httpx.Client(base_url=base_url, timeout=120) as client:
            while not done.is_set():
                with client.stream("POST", CHAT, json=long_chat()) as response:
                    for line in response.iter_lines():
                        if line.startswith("data: "):
                            stamps.append(time.perf_counter())
                        if done.is_set():
                            return  # leaving aborts this anonymous generation

    follower = threading.Thread(target=follow)
    follower.start()
    while len(stamps) < 20:
        time.sleep(0.01)
    lag_before = _loop_lag_buckets(base_url)
    window_start = time.perf_counter()
    sender = [sys.executable, "-c", OVERSIZED_SENDER, base_url, json.dumps(VALID_CHAT)]
    refusals = subprocess.run(sender, capture_output=True, text=True, timeout=300, check=True).stdout
    window_end = time.perf_counter()
    lag = {le: count - lag_before[le] for le, count in _loop_lag_buckets(base_url).items()}
    time.sleep(0.5)
    done.set()
    follower.join(timeout=60)
    assert json.loads(refusals) == [400] * 12
    in_window = [t for t in stamps if window_start <= t <= window_end + 0.5]
    gaps = [
        later - earlier for earlier, later in zip(stamps, stamps[1:], strict=False) if later >= window_start
    ]
    worst = max(gaps)
    print(f"worst inter-token gap while 12 oversized prompts were refused: {worst * 1000:.0f} ms")
    late = lag["+Inf"] - lag["0.1"]
    print(f"the server's loop-lag samples meanwhile: {lag['+Inf']:.0f}, of them over 0.1 s: {late:.0f}")
    assert len(in_window) >= 2  # the stream kept going while they were refused
    # Generous (the engine spins on the same 2 cores): a stalled loop gave 4.3 s; a free one
    # gives ~0.1 s here. The measured figure is in README.
    assert worst < 1.0
    assert lag["+Inf"] == lag["1.0"]  # and the server's own loop never waited a second


def _loop_lag_buckets(base_url: str) -> dict[str, float]:
    """bundle_event_loop_lag_seconds' cumulative bucket counts by upper bound ('+Inf' = all)."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    pattern = r'^bundle_event_loop_lag_seconds_bucket\{le="([^"]+)"\} (\S+)$'
    return {le: float(count) for le, count in re.findall(pattern, text, re.M)}


def _aborted(service: Service, reason: str) -> float:
    return service.metrics.aborted_requests.labels(reason)._value.get()


def _none_running(service: Service) -> None:
    """Wait until no generation runs: the test before may have left one whose abort (its client
    gone) lands late on a loaded machine, and would count in this test's counters."""
    wait_until(lambda: service.stats()["running_generations"] == 0, timeout=120.0)


@contextlib.contextmanager
def _left_mid_generation(base_url: str, gate: Gate, *extra_headers: bytes) -> Iterator[None]:
    """A non-streaming client that sends a long chat and leaves (closes its connection) while the
    generation runs: held in the engine (frozen) until the block ends, so it cannot finish first."""
    url = httpx.URL(base_url)
    with gate.hold(after=1, freeze_engine=True) as held:
        messages = [{"role": "user", "content": held.prompt("tell me a long story")}]
        body = orjson.dumps(long_chat(stream=False, messages=messages))
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n" % len(body) + b"".join(extra_headers) + b"\r\n"
        )
        with socket.create_connection((url.host, url.port), timeout=10) as sock:
            sock.sendall(head + body)
            held.wait_held()
        yield


def test_an_anonymous_non_streaming_client_that_leaves_aborts_its_generation(
    base_url: str, service: Service, gate: Gate
) -> None:
    _none_running(service)
    before = _aborted(service, "disconnect")
    with _left_mid_generation(base_url, gate):
        wait_until(lambda: _aborted(service, "disconnect") == before + 1, timeout=60.0)
        wait_until(lambda: service.engine.running_requests() == 0, timeout=60.0)


def test_a_named_non_streaming_client_that_leaves_keeps_its_grace_window(
    base_url: str, service: Service, gate: Gate
) -> None:
    _none_running(service)
    with _left_mid_generation(base_url, gate, b"X-Request-Id: non-streaming-grace\r\n"):
        wait_until(lambda: service.stats()["subscribers"] == 0, timeout=60.0)  # the server saw it leave
        assert service.engine.running_requests() >= 1  # still generating: the client may come back
        with httpx.Client(base_url=base_url, timeout=30) as client:
            assert client.post("/v1/requests/non-streaming-grace/cancel").json()["status"] == "cancelled"
        wait_until(lambda: service.engine.running_requests() == 0, timeout=60.0)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "json_object"}}, "response_format"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
                "tool_choice": "required",
            },
            "tools",
        ),
    ],
)
async def test_what_an_engine_cannot_serve_is_a_400_naming_it(scripted: App, extra: dict, param: str) -> None:
    """An engine without structured output or tools behind it (here the scripted one) refuses
    through the protocol's own methods: the client's 400 naming the field, not a 500."""
    before = _generations(scripted.service)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    response = await scripted.client.post("/v1/chat/completions", json=body)
    _assert_openai_error(response, 400)
    assert response.json()["error"]["param"] == param
    assert _generations(scripted.service) == before
