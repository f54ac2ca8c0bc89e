"""Bounded graceful shutdown: after SIGTERM, running streams get `shutdown_grace_s`, then end
with a "server shutting down" error event (not "engine died"), and the process exits 0.

Streams that must still be running when the test acts are held in the engine (tests/gate.py),
so that "running through the grace" is a state the test sets, not a race against the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
import uvicorn
from fastapi import FastAPI

from bench.servers import wait_healthy
from shared.http.api import create_app
from shared.server_state import ENGINE_DEAD_EXIT_CODE
from shared.settings import Settings
from tests.conftest import ENGINE_SETTINGS, LiveServers, free_port, long_chat
from tests.gate import Gate, GatedEngine
from tests.real_server import START_TIMEOUT_S, RealStart, data_events

GRACE_S = 1.0
SHORT = 8  # tokens of a stream that finishes within the grace (~10 ms of the tiny model's time)


@pytest.fixture
def gated_app(live: LiveServers, tmp_path: Path) -> Iterator[tuple[str, FastAPI, Gate]]:
    """An app of its own on the session's engine, behind a gate (a drain aborts only this app's
    generations; the gate holds only the generations whose prompt carries its key)."""
    gate = Gate(tmp_path)
    settings = Settings(**{**ENGINE_SETTINGS.model_dump(), "shutdown_grace_s": GRACE_S})
    app = create_app(settings, engine=GatedEngine(live.engine, tmp_path))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))

    serving: list[asyncio.Task[None]] = []

    async def start() -> None:
        serving.append(live.loop.create_task(server.serve()))
        while not server.started:
            await asyncio.sleep(0.01)

    async def stopped() -> None:
        server.should_exit = True
        await asyncio.wait(serving, timeout=60)

    live.call(start())
    try:
        yield f"http://127.0.0.1:{port}", app, gate
    finally:
        gate.release_all()
        # Its lifespan's shutdown ends here, not in a loop the session has already closed.
        live.call(stopped())


def _chat(prompt: str, **extra: object) -> dict[str, object]:
    return long_chat(messages=[{"role": "user", "content": prompt}], **extra)


def _read_events(response: httpx.Response, into: list[str]) -> None:
    into.extend(data_events(response.iter_lines()))


def test_streams_run_through_the_grace_then_end_with_a_shutdown_event(
    live: LiveServers, gated_app: tuple[str, FastAPI, Gate]
) -> None:
    """Two streams are running when the signal comes (held in the engine): one is let go at
    once and finishes during the grace with its own end; the other, still held, is ended by the
    grace timer with `server_shutting_down`. A request that reaches the app after the signal
    gets 503."""
    url, app, gate = gated_app
    with httpx.Client(base_url=url, timeout=60) as client, gate.hold(after=2) as long_one:
        short_one = gate.close(after=2)
        headers = {"X-Request-Id": "drain-me"}
        long_events: list[str] = []
        short_events: list[str] = []
        with (
            client.stream(
                "POST", "/v1/chat/completions", json=_chat(long_one.prompt("story")), headers=headers
            ) as long_r,
            client.stream(
                "POST", "/v1/chat/completions", json=_chat(short_one.prompt("short"), max_tokens=SHORT)
            ) as short_r,
        ):
            long_one.wait_held()
            short_one.wait_held()

            async def signal_arrives() -> None:  # what shared.http.process does on SIGTERM
                app.state.server_state.begin_shutdown(app.state.service)

            # The clock starts before the signal: its grace timer starts inside the call, and
            # a clock read after the call returned ran behind the timer (0.9995 s measured once).
            signalled = time.monotonic()
            live.call(signal_arrives())
            short_one.release()
            reader = threading.Thread(target=_read_events, args=(short_r, short_events))
            reader.start()
            refused = httpx.post(f"{url}/v1/chat/completions", json=_chat("after", max_tokens=2), timeout=60)
            _read_events(long_r, long_events)
            ended = time.monotonic() - signalled
            reader.join(60)
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "server_shutting_down"
    assert long_events[-1] == "[DONE]"
    error = orjson.loads(long_events[-2])["error"]
    assert error["code"] == "server_shutting_down" and "X-Request-Id" in error["message"]
    assert GRACE_S <= ended < GRACE_S + 30  # ended by the grace timer (bound: a loaded box)
    assert short_events[-1] == "[DONE]"  # the stream let go finished during the grace, normally
    finishes = [c["finish_reason"] for d in short_events[:-1] for c in orjson.loads(d).get("choices", ())]
    assert finishes[-1] in ("length", "stop"), short_events[-3:]


def test_sigterm_to_the_whole_group_says_shutting_down_not_engine_died(real_start: RealStart) -> None:
    # The engine core gets the signal too and stops at once; clients must hear "shutting down".
    # The server is the start-up test's: the benchmark ends it this way, a stream running.
    ended = real_start.sigterm
    if isinstance(ended, BaseException):
        raise ended
    assert ended.rest[-1] == "[DONE]"
    error = orjson.loads(ended.rest[-2])["error"]
    assert error["code"] == "server_shutting_down", error
    # A drain asked by a signal ends with 0, not with the signal (shared/http/process.py).
    assert ended.exit_code == 0 != ENGINE_DEAD_EXIT_CODE, ended.log.read_text()[-3000:]
    print(f"server exited {ended.seconds:.1f} s after SIGTERM to its group")


@contextlib.contextmanager
def gated_server(
    log_dir: Path, gate_dir: Path, **settings: str
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A real `python -m shared.serve` (through tests/gated_serve.py: its engine behind the gate),
    in its own process group."""
    port = free_port()
    env = {
        **os.environ,
        "BUNDLE_MAX_MODEL_LEN": "2048",
        "BUNDLE_ENFORCE_EAGER": "true",
        "BUNDLE_LOG_LEVEL": "warning",
        **{f"BUNDLE_{key.upper()}": value for key, value in settings.items()},
    }
    log = log_dir / "server.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.gated_serve", "--gate-dir", str(gate_dir), "--port", str(port)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            process_group=0,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_healthy(url, process, START_TIMEOUT_S)
        except RuntimeError as exc:
            raise AssertionError(f"{exc}: {log.read_text()[-2000:]}") from None
        yield url, process
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


def test_after_sigterm_new_connections_are_refused_and_the_drain_exits_0(tmp_path: Path) -> None:
    """What docs/api.md says of a SIGTERM to the server process: the listener closes at once (a
    new connection is refused: a load balancer moves on), an open keep-alive connection is
    closed, a running stream (held in the engine) gets the grace and then its
    `server_shutting_down` event, and the process exits 0 rather than dying of the signal."""
    gate = Gate(tmp_path)
    with gated_server(tmp_path, tmp_path, shutdown_grace_s=str(GRACE_S)) as (url, process):
        held = gate.close(after=2)
        with httpx.Client(base_url=url, timeout=60) as client, httpx.Client(base_url=url, timeout=60) as idle:
            assert idle.get("/health").status_code == 200  # a keep-alive connection, left open
            body = _chat(held.prompt("story"))
            with client.stream(
                "POST", "/v1/chat/completions", json=body, headers={"X-Request-Id": "s"}
            ) as response:
                held.wait_held()
                signalled = time.monotonic()
                process.send_signal(signal.SIGTERM)
                refused_after = _until_refused(url)
                with pytest.raises(httpx.TransportError):
                    idle.get("/health")  # closed by the server; a new connection is refused
                rest = data_events(response.iter_lines())
                stream_ended = time.monotonic() - signalled
        code = process.wait(timeout=60)
        exited = time.monotonic() - signalled
    assert rest[-1] == "[DONE]"
    assert orjson.loads(rest[-2])["error"]["code"] == "server_shutting_down"
    assert GRACE_S <= stream_ended < GRACE_S + 30
    assert code == 0, (tmp_path / "server.log").read_text()[-3000:]
    print(
        f"\nSIGTERM: new connections refused after {refused_after:.2f} s, the held stream ended at "
        f"{stream_ended:.2f} s (grace {GRACE_S} s), the process exited 0 at {exited:.2f} s"
    )


def _until_refused(url: str, within_s: float = 30) -> float:
    """Seconds until a new connection to `url` is refused; a request that still gets in before
    that is refused with 503 (nothing is started after the signal)."""
    started = time.monotonic()
    while time.monotonic() - started < within_s:
        try:
            answer = httpx.post(f"{url}/v1/chat/completions", json=_chat("late", max_tokens=1), timeout=5)
        except httpx.ConnectError:
            return time.monotonic() - started
        assert answer.status_code == 503, answer.text
        time.sleep(0.01)
    raise AssertionError(f"new connections were still accepted {within_s} s after SIGTERM")


def test_a_generation_vllm_aborts_on_its_own_ends_with_an_error_not_a_finish(
    live: LiveServers, gated_app: tuple[str, FastAPI, Gate]
) -> None:
    # vLLM's engine core ends every running request with finish reason "abort" on SIGTERM (0.32+),
    # racing its own exit: the group-SIGTERM test above sees that output in some runs. The same
    # output comes, on demand, from `AsyncLLM.abort` called by someone other than the bundle,
    # here while the request is held in the (paused) engine, so it cannot have finished first.
    url, _, gate = gated_app
    llm = live.engine.llm  # type: ignore[attr-defined]

    async def abort_everything_running() -> None:
        await llm.abort(list(llm.output_processor.external_req_ids))

    named = {"X-Request-Id": "cut-off-by-vllm"}
    with httpx.Client(base_url=url, timeout=60) as http:
        with gate.hold(after=2, freeze_engine=True) as held:
            body = _chat(held.prompt("story"), max_tokens=1000, stream_options={"include_usage": True})
            with http.stream("POST", "/v1/chat/completions", json=body, headers=named) as response:
                held.wait_held()
                live.call(abort_everything_running())
                held.release()
                rest = data_events(response.iter_lines())
        assert rest[-1] == "[DONE]"
        error = orjson.loads(rest[-2])["error"]
        assert error["code"] == "engine_unavailable", error  # a failure, not a cut-off answer
        finishes = [c["finish_reason"] for d in rest[:-2] for c in orjson.loads(d).get("choices", ())]
        assert not any(finishes), finishes
        assert http.get("/health").status_code == 200  # the engine itself is fine
        assert live.engine.running_requests() == 0
        # What the error's advice says: the same id replays this end, a new id runs the request.
        assert "new X-Request-Id" in error["message"]
        replayed = data_events(http.post("/v1/chat/completions", json=body, headers=named).iter_lines())
        assert orjson.loads(replayed[-2])["error"] == error
        fresh = {"X-Request-Id": "cut-off-by-vllm-again"}
        again = http.post(
            "/v1/chat/completions", json={**body, "max_tokens": 4, "stream": False}, headers=fresh
        )
        assert again.status_code == 200 and again.json()["choices"][0]["finish_reason"] == "length"
