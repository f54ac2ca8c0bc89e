"""What the HTTP layer uses of uvicorn's and Starlette's internals (shared/http/server_internals.py)
is found on the installed releases, which are the ones pyproject allows and the images pin: an
upgrade that drops one fails here. A missing member is made by changing the real class for the
test's duration (a release without it cannot be installed beside the pinned one): its check then
reports the fallback, and the server still answers on the fallback's path. No engine but for the
real start's log line: part of `make check`, and of the Python 3.12 run (the eager start exists
only there)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import sys
import tomllib
from collections.abc import AsyncIterator, Callable
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any
from unittest import mock

import httpx
import orjson
import pytest
import uvicorn
from packaging.requirements import Requirement
from starlette.responses import Response, StreamingResponse
from starlette.types import Message, Scope
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from shared.http import server_internals
from shared.http.api import create_app
from shared.http.direct_write import direct_write
from shared.http.limits import LingeringClose, lingering_h11_protocol, uvicorn_options
from shared.http.process import DrainingServer, run_server
from shared.http.requests import EventStreamResponse
from shared.obs.internals_check import Found, InternalsCheck
from shared.obs.metrics import Metrics
from shared.obs.process_metrics import add_up
from shared.settings import Settings

from .conftest import WITHOUT_ENGINE, free_port
from .scripted import ScriptedEngine

if TYPE_CHECKING:
    from .real_server import RealStart  # it needs psutil and the benchmark, which the 3.12 run has not

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]
# Every use checked, so that a check dropped or added is a decision seen here.
FEATURES = {
    "httptools_protocol",
    "arrival_stamp",
    "request_start",
    "eager_start",
    "httptools_lingering_close",
    "h11_lingering_close",
    "direct_write",
    "signal_exit",
    "response_init",
}
EAGER = "eager_task" if sys.version_info >= (3, 12) else "queued_before_python_3_12"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "a b"}], "max_tokens": 2}


def moved(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function`'s behaviour from code that names none of its attributes: a release that sets
    them somewhere the check does not look (or not at all) reads the same to the check."""

    @functools.wraps(function)
    def elsewhere(*args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs)

    return elsewhere


def path_of(check: InternalsCheck, feature: str) -> tuple[str, str]:
    (found,) = [f for f in check.found if f.feature == feature]
    return found.path, found.kind


# --- the pinned releases ------------------------------------------------------------------------------
def test_the_installed_releases_take_no_fallback_path() -> None:
    check = server_internals.detect()
    assert {f.feature for f in check.found} == FEATURES
    assert check.fallbacks() == (), check.log_line()
    assert path_of(check, "eager_start") == (EAGER, "expected" if sys.version_info >= (3, 12) else "platform")
    assert check.releases == (f"uvicorn {uvicorn.__version__}", f"starlette {metadata.version('starlette')}")
    assert server_internals.found() == check


def test_pyproject_allows_the_uvicorn_this_run_tests() -> None:
    """The range is what the tests run: 0.54 (the images' pin, the Python 3.12 run) to 0.55."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (text,) = [dep for dep in project["dependencies"] if Requirement(dep).name == "uvicorn"]
    assert Requirement(text).specifier.contains(uvicorn.__version__), (text, uvicorn.__version__)


def test_the_check_is_one_line_and_a_series_per_use(caplog: pytest.LogCaptureFixture) -> None:
    check = server_internals.detect()
    with caplog.at_level(logging.INFO, logger="shared.http.server_internals"):
        server_internals.log_found(check)
    (record,) = caplog.records
    assert record.levelno == logging.INFO
    assert record.getMessage().startswith(f"server internals: uvicorn {uvicorn.__version__}, starlette ")
    assert all(f"{f.component}.{f.feature}={f.path}" in record.getMessage() for f in check.found)
    metrics = Metrics()
    metrics.show_server_features(check.found)
    text = metrics.exposition().decode()
    for f in check.found:
        labels = f'component="{f.component}",feature="{f.feature}",path="{f.path}"'
        assert f"bundle_server_features{{{labels}}} 1.0" in text
    assert text.count("bundle_server_features{") == len(FEATURES)


def test_several_api_processes_add_up_to_how_many_took_each_path() -> None:
    processes = [Metrics(), Metrics()]
    for metrics in processes:
        metrics.show_server_features(server_internals.found().found)
    merged = add_up([list(metrics.registry.collect()) for metrics in processes])
    (family,) = [m for m in merged if m.name == "bundle_server_features"]
    assert len(family.samples) == len(FEATURES)
    assert {sample.value for sample in family.samples} == {2.0}


def test_a_fallback_is_a_warning_naming_it(caplog: pytest.LogCaptureFixture) -> None:
    check = InternalsCheck(("uvicorn 9.9",), (Found("uvicorn", "direct_write", "send_only", "fallback"),))
    with caplog.at_level(logging.INFO, logger="shared.http.server_internals"):
        server_internals.log_found(check)
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "(fallbacks: uvicorn.direct_write)" in record.getMessage()
    assert "uvicorn.direct_write=send_only (fallback)" in record.getMessage()


def test_the_server_process_hands_its_check_to_the_app(monkeypatch: pytest.MonkeyPatch) -> None:
    apps: list[Any] = []
    monkeypatch.setattr(DrainingServer, "run", lambda server, sockets=None: apps.append(server.config.app))
    assert run_server(Settings(), lambda request_exit: create_app(Settings())) == 0
    assert apps[0].state.server_internals == server_internals.found()


async def _features_on_metrics(internals: InternalsCheck | None) -> list[str]:
    app = create_app(Settings(), engine=ScriptedEngine(auto=True))
    app.state.server_internals = internals  # as run_server sets it; None: another server runs it
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://bundle") as client:
            text = (await client.get("/metrics")).text
    return [line for line in text.splitlines() if line.startswith("bundle_server_features{")]


async def test_the_apps_metrics_show_the_check_it_was_handed() -> None:
    check = server_internals.found()
    assert len(await _features_on_metrics(check)) == len(FEATURES)
    assert await _features_on_metrics(None) == []


@pytest.mark.skipif(bool(os.environ.get(WITHOUT_ENGINE)), reason="a real start needs the engine")
@pytest.mark.timeout(600)  # the session's real start may begin here
def test_a_real_start_reports_every_use_in_one_line(real_start: RealStart) -> None:
    """`python -m shared.serve` (the session's one real start) says it before serving."""
    from .real_server import GroupSigterm

    ended = real_start.sigterm
    assert isinstance(ended, GroupSigterm), ended
    lines = [line for line in ended.log.read_text().splitlines() if "server internals" in line]
    assert len(lines) == 1, lines
    assert lines[0].startswith("INFO:") and f"uvicorn {uvicorn.__version__}" in lines[0]
    assert all(f"{feature}=" in lines[0] for feature in FEATURES)


# --- each check sees a release without what it reads ----------------------------------------------------
def test_each_check_reports_a_fallback_when_its_member_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test of the pinned releases above can fail: take each member away and its check says so."""
    with monkeypatch.context() as patch:
        patch.delattr(HttpToolsProtocol, "_start_asgi_task")
        assert path_of(server_internals.detect(), "request_start") == ("at_head", "fallback")
    with monkeypatch.context() as patch:
        patch.delattr(FlowControl, "resume_reading")
        assert path_of(server_internals.detect(), "request_start") == ("at_head", "fallback")
    with monkeypatch.context() as patch:
        patch.setattr(HttpToolsProtocol, "on_message_begin", moved(HttpToolsProtocol.on_message_begin))
        assert path_of(server_internals.detect(), "arrival_stamp") == ("app_entry", "fallback")
    with monkeypatch.context() as patch:
        patch.setattr(RequestResponseCycle, "__init__", moved(RequestResponseCycle.__init__))
        check = server_internals.detect()
        assert path_of(check, "httptools_lingering_close") == ("plain_close", "fallback")
        assert path_of(check, "direct_write") == ("send_only", "fallback")
        assert path_of(check, "request_start") == ("at_head", "fallback")
    with monkeypatch.context() as patch:
        patch.delattr(RequestResponseCycle, "send")
        assert path_of(server_internals.detect(), "direct_write") == ("send_only", "fallback")
    with monkeypatch.context() as patch:
        patch.setattr(H11Protocol, "__init__", moved(H11Protocol.__init__))
        assert path_of(server_internals.detect(), "h11_lingering_close") == ("plain_close", "fallback")
    with monkeypatch.context() as patch:
        patch.setattr(uvicorn.Server, "__init__", moved(uvicorn.Server.__init__))
        assert path_of(server_internals.detect(), "signal_exit") == ("signal_raised_again", "fallback")
    with monkeypatch.context() as patch:
        patch.delattr(Response, "init_headers")
        assert path_of(server_internals.detect(), "response_init") == ("constructor", "fallback")
    with monkeypatch.context() as patch:
        patch.setattr(StreamingResponse, "__init__", _init_with_a_new_field)
        assert path_of(server_internals.detect(), "response_init") == ("constructor", "fallback")
    if sys.version_info >= (3, 12):
        with monkeypatch.context() as patch:
            patch.setattr(uvicorn.Config, "__init__", moved(uvicorn.Config.__init__))
            assert path_of(server_internals.detect(), "eager_start") == ("queued", "fallback")
    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, "uvicorn.protocols.http.httptools_impl", None)  # no httptools
        check = server_internals.detect()
        assert path_of(check, "httptools_protocol") == ("h11_without_head_timeout", "fallback")
        for feature in ("arrival_stamp", "request_start", "httptools_lingering_close", "direct_write"):
            assert path_of(check, feature)[1] == "fallback", feature
    assert server_internals.detect().fallbacks() == ()  # all back


_streaming_init = StreamingResponse.__init__


def _init_with_a_new_field(self: StreamingResponse, *args: Any, **kwargs: Any) -> None:
    """StreamingResponse's constructor in a release that sets one more field."""
    _streaming_init(self, *args, **kwargs)
    self.charset_guessed = False  # type: ignore[attr-defined]


# --- the fallback paths still serve -----------------------------------------------------------------------
@contextlib.asynccontextmanager
async def served(app: Any, **options: Any) -> AsyncIterator[httpx.AsyncClient]:
    """`app` under a real uvicorn in this loop, with `options` (its protocol, above all)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **options))
    serving = asyncio.create_task(server.serve())
    try:
        while not server.started:
            assert not serving.done(), "the server stopped while starting"
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            yield client
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 10)


async def _small_and_oversized(client: httpx.AsyncClient, limit: int) -> None:
    """A small chat is answered; a body over `limit` gets the 413 and a closed connection."""
    answered = await client.post("/v1/chat/completions", json=CHAT)
    assert answered.status_code == 200, answered.text
    oversized = orjson.dumps({**CHAT, "user": "u" * 2 * limit})
    refused = await client.post(
        "/v1/chat/completions", content=oversized, headers={"content-type": "application/json"}
    )
    assert refused.status_code == 413, refused.text
    assert refused.json()["error"]["code"] == "request_too_large"
    assert refused.headers["connection"] == "close"


async def test_without_uvicorns_task_hook_requests_start_at_their_head_and_are_answered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A release whose hook takes another argument: uvicorn starts every task at its head itself,
    and a body over the cap is refused by the app's own read (a 413 either way)."""
    started: list[object] = []
    own_start = HttpToolsProtocol._start_asgi_task

    def start_with_a_context(self: Any, cycle: Any, app: Any, context: object = None) -> None:
        started.append(cycle)
        own_start(self, cycle, app)

    monkeypatch.setattr(HttpToolsProtocol, "_start_asgi_task", start_with_a_context)
    check = server_internals.detect()
    assert path_of(check, "request_start") == ("at_head", "fallback")
    settings = Settings(max_body_bytes=4096)
    app = create_app(settings, engine=ScriptedEngine(auto=True))
    async with served(app, **uvicorn_options(settings, check)) as client:
        await _small_and_oversized(client, settings.max_body_bytes)
    assert len(started) == 2  # both through uvicorn's own start


async def test_without_the_cycles_fields_streams_go_through_send_and_closes_are_plain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(RequestResponseCycle, "__init__", moved(RequestResponseCycle.__init__))
    check = server_internals.detect()
    assert path_of(check, "direct_write") == ("send_only", "fallback")
    monkeypatch.setattr(server_internals, "found", lambda: check)
    settings = Settings(max_body_bytes=4096, stream_direct_writes=True)
    app = create_app(settings, engine=ScriptedEngine(auto=True))
    async with served(app, **uvicorn_options(settings, check)) as client:
        streamed = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
        await _small_and_oversized(client, settings.max_body_bytes)
        metrics = (await client.get("/metrics")).text
    assert 'bundle_direct_write_fallbacks_total{reason="server"} 1.0' in metrics


async def test_without_the_protocols_scope_admission_is_timed_from_the_app(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(HttpToolsProtocol, "on_message_begin", moved(HttpToolsProtocol.on_message_begin))
    check = server_internals.detect()
    assert path_of(check, "arrival_stamp") == ("app_entry", "fallback")
    settings = Settings()
    app = create_app(settings, engine=ScriptedEngine(auto=True))
    async with served(app, **uvicorn_options(settings, check)) as client:
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
        metrics = (await client.get("/metrics")).text
    assert "bundle_admission_seconds_count 1.0" in metrics


async def test_without_h11s_connection_state_h11_closes_plainly_and_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(H11Protocol, "__init__", moved(H11Protocol.__init__))
    check = server_internals.detect()
    assert path_of(check, "h11_lingering_close") == ("plain_close", "fallback")
    settings = Settings(max_body_bytes=4096)
    app = create_app(settings, engine=ScriptedEngine(auto=True))
    options = {**uvicorn_options(settings, check), "http": lingering_h11_protocol(check)}
    async with served(app, **options) as client:
        await _small_and_oversized(client, settings.max_body_bytes)


@pytest.mark.skipif(sys.version_info < (3, 12), reason="eager tasks are Python 3.12's")
async def test_without_the_eager_starts_fields_small_requests_start_queued(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(uvicorn.Config, "__init__", moved(uvicorn.Config.__init__))
    check = server_internals.detect()
    assert path_of(check, "eager_start") == ("queued", "fallback")
    settings = Settings(max_body_bytes=4096)
    app = create_app(settings, engine=ScriptedEngine(auto=True))
    async with served(app, **uvicorn_options(settings, check)) as client:
        await _small_and_oversized(client, settings.max_body_bytes)


async def test_without_httptools_the_server_runs_h11(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvicorn.protocols.http.httptools_impl", None)
    check = server_internals.detect()
    settings = Settings(max_body_bytes=4096)
    options = uvicorn_options(settings, check)
    assert options["http"].__name__ == "LingeringH11Protocol"
    app = create_app(settings, engine=ScriptedEngine(auto=True))
    async with served(app, **options) as client:
        await _small_and_oversized(client, settings.max_body_bytes)


def test_without_the_captured_signals_uvicorn_keeps_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback is uvicorn's own end: the signal raised again, the process dying of it."""
    server = uvicorn.Server(uvicorn.Config(create_app(Settings())))
    server.handle_exit(15, None)
    monkeypatch.setattr(uvicorn.Server, "__init__", moved(uvicorn.Server.__init__))
    monkeypatch.setattr(server_internals, "found", server_internals.detect)
    server_internals.forget_captured_signals(server)
    assert server._captured_signals == [15]
    monkeypatch.undo()
    server_internals.forget_captured_signals(server)  # the pinned release: forgotten
    assert server._captured_signals == []


async def _sse_messages(response: EventStreamResponse) -> list[Message]:
    sent: list[Message] = []

    async def receive() -> Message:
        await asyncio.Event().wait()  # the client never leaves
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    scope: Scope = {"type": "http", "method": "GET", "headers": []}
    await response(scope, receive, send)
    return sent


async def _events() -> AsyncIterator[bytes]:
    yield b"data: 1\n\n"
    yield b"data: [DONE]\n\n"


async def test_without_the_constructors_known_fields_the_response_is_built_by_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An SSE response made through Starlette's own constructor sends what the direct one does."""
    direct = await _sse_messages(EventStreamResponse(_events(), headers={"X-Request-Id": "r"}))
    monkeypatch.setattr(StreamingResponse, "__init__", _init_with_a_new_field)
    check = server_internals.detect()
    assert path_of(check, "response_init") == ("constructor", "fallback")
    monkeypatch.setattr(server_internals, "found", lambda: check)
    built = await _sse_messages(EventStreamResponse(_events(), headers={"X-Request-Id": "r"}))
    assert built == direct
    assert direct[0]["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in direct[0]["headers"]
    assert [m.get("body") for m in direct[1:]] == [b"data: 1\n\n", b"data: [DONE]\n\n", b""]


async def test_a_server_without_uvicorns_cycle_offers_no_direct_write() -> None:
    """`send` of another server (a middleware's wrapper, Modal's runner): none, said once."""
    reasons: list[str] = []

    async def send(message: Message) -> None:
        return None

    assert direct_write(send, reasons.append) is None
    assert reasons == ["server"]


# --- the transport uvicorn's protocols are given ---------------------------------------------------------
TRANSPORT_METHODS = sorted(name for name in dir(asyncio.Transport) if not name.startswith("_"))


class Idle:
    lingering = False

    def request_body_unread(self) -> bool:
        return False


def test_the_lingering_transport_implements_asyncio_transport_by_hand() -> None:
    """No pass-everything `__getattr__`: each of asyncio.Transport's methods is its own and goes
    to the connection's transport; nothing else of that transport is reachable through it."""
    assert "__getattr__" not in vars(LingeringClose)
    assert [name for name in TRANSPORT_METHODS if name not in vars(LingeringClose)] == []
    inner = mock.create_autospec(asyncio.Transport, instance=True)
    inner.is_closing.return_value = False
    loop = asyncio.new_event_loop()
    proxy = LingeringClose(inner, Idle(), loop)
    arguments: dict[str, tuple[Any, ...]] = {
        "get_extra_info": ("peername",),
        "set_protocol": (asyncio.Protocol(),),
        "write": (b"x",),
        "writelines": ([b"x"],),
    }
    for name in TRANSPORT_METHODS:
        getattr(proxy, name)(*arguments.get(name, ()))
        assert getattr(inner, name).called, name
    with pytest.raises(AttributeError):
        proxy.mock_calls  # type: ignore[attr-defined]  # noqa: B018
    # The hot path: the connection's own bound methods, not a call through the proxy.
    assert proxy.write is inner.write and proxy.is_closing is inner.is_closing
    loop.close()
