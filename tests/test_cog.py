"""The Cog runner, proven against the real Cog server (coglet 0.23.1) and the real CPU engine.

One server for the module: `python -m cog.server.http` from the repository root (tests/cog_server.py)
with the real runner plus the holds a test controls (tests/cog_hold_runner.py: a prediction the
test did not mark runs exactly as under cog/predict.py), COG_MAX_CONCURRENCY=4, the tiny model.
A test that needs a stream still running holds its generation's outputs in the engine and
releases them, instead of racing the engine; texts are compared joined, not by chunk. The unit
tests above it need no server. The cancel windows and the hostile loop: tests/test_cog_cancel.py.

Observing the engine from outside: every prediction reports, in its `metrics`,
`engine_running_requests` = vLLM's own count of unfinished requests read just before that
prediction is admitted; the runner also writes that count to a file every 50 ms.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import cog_bridge as bridge
import cog_cancel
import cog_inputs
import httpx
import pytest
import yaml

from shared.errors import InvalidRequest
from shared.service import Service
from shared.settings import Settings

from .cog_server import (
    HOLD_RUNNER_REF,
    ROOT,
    RUNNER_REF,
    CogServer,
    Stream,
    engine_killed_under_a_prediction,
    health_status,
    launch,
    probe,
    running_cog_server,
    sse_prediction,
    stop,
    until,
    wait_ready,
)
from .conftest import free_port
from .scripted import ScriptedEngine, settle

# Other test modules import these from here.
__all__ = [
    "LONG",
    "CogServer",
    "_health_status",
    "_launch",
    "_stop",
    "running_cog_server",
    "sse_prediction",
]
_launch, _stop, _health_status = launch, stop, health_status

SERVER_LIMIT_MAX_TOKENS = 1800  # set through BUNDLE_* to prove the environment reaches the runner
LONG = {"prompt": "tell me a long story", "max_tokens": 900, "temperature": 1.0}
SLOTS = 4


# --- no server ------------------------------------------------------------------------------
def test_schema_file_matches_runner_signature() -> None:
    """`make cog-schema` output must equal the checked-in file (run it after changing run())."""
    fresh = subprocess.run(
        [sys.executable, "cog/cog_schema.py", RUNNER_REF],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("BUNDLE_")},
    ).stdout
    checked_in = (ROOT / ".cog" / "openapi_schema.json").read_text()
    assert fresh == checked_in, "run() changed: regenerate with `make cog-schema`"
    schema = json.loads(checked_in)
    assert schema["paths"]["/predictions"]["post"]["x-cog-streaming"] is True
    assert schema["components"]["schemas"]["Output"]["x-cog-array-type"] == "iterator"
    inputs = schema["components"]["schemas"]["Input"]["properties"]
    assert set(inputs) == {
        "prompt",
        "system_prompt",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "presence_penalty",
        "frequency_penalty",
        "min_tokens",
        "stop_sequences",
        "prompt_template",
        "seed",
        "json_schema",
        "tools",
        "request_id",
        "lora",
    }
    assert inputs["max_tokens"]["maximum"] == Settings().max_tokens_limit


def test_cog_yaml_pins_and_matches_runner() -> None:
    config = yaml.safe_load((ROOT / "cog.yaml").read_text())
    assert config["run"] == RUNNER_REF
    assert config["build"]["gpu"] is True
    pins = (ROOT / config["build"]["python_requirements"]).read_text()
    assert any(line.startswith("vllm==") for line in pins.splitlines())  # tests/test_pins.py checks the rest
    source = (ROOT / "cog" / "predict.py").read_text()
    decorated = re.search(r"@cog\.concurrent\(max=(\d+)\)", source)
    assert decorated and int(decorated.group(1)) == config["concurrency"]["max"]
    assert not (ROOT / "cog" / "__init__.py").exists()  # would shadow the cog SDK


def test_inputs_become_a_chat_request() -> None:
    settings = Settings()
    body = cog_inputs.chat_request_from_inputs(
        settings,
        prompt="hi",
        system_prompt="be brief",
        max_tokens=7,
        top_k=0,
        stop_sequences="END,,\nSTOP ",
        seed=3,
    )
    assert body.message_dicts() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    assert (body.max_tokens, body.top_k, body.stop_list, body.seed, body.stream) == (
        7,
        None,
        ("END", "\nSTOP "),  # whitespace is stop text (tests/test_cog_inputs.py has more)
        3,
        False,
    )
    assert cog_inputs.split_stop_sequences(["a", " b "]) == ["a", " b "]
    with pytest.raises(InvalidRequest, match="stop_sequences takes up to 4"):
        cog_inputs.chat_request_from_inputs(settings, prompt="hi", stop_sequences="a,b,c,d,e")


def test_weights_choose_the_model() -> None:
    assert bridge.runner_settings("/src/weights", Settings()).model == "/src/weights"
    assert bridge.runner_settings(None, Settings(model="org/m")).model == "org/m"


@contextlib.contextmanager
def engine_loop() -> Iterator[tuple[asyncio.AbstractEventLoop, Callable[[Any], Any]]]:
    """An event loop in a thread of its own, as the Cog runner keeps one beside coglet's slot
    threads, and a way to run a coroutine on it from the test's thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def on_loop(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(5)

    try:
        yield loop, on_loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


@pytest.mark.timeout(20)  # a runner that batches by count would wait here for tokens never released
def test_a_reader_that_keeps_up_gets_one_token_per_item_and_a_late_one_its_backlog() -> None:
    """Token by token, exactly: the runner's stream (`bridge.stream_text`, run in a thread as
    coglet's slot thread runs it) on the scripted engine, which emits only the tokens released
    here. A reader waiting for the next token gets it alone; one that falls behind (a loaded host)
    gets everything since its last read in one item, which is why the real-server test below
    does not count its items."""
    engine = ScriptedEngine()

    async def start() -> Any:
        service = Service(Settings(), engine)
        body = cog_inputs.chat_request_from_inputs(service.settings, prompt="a b c", max_tokens=8)
        subscription = await bridge.start_generation(service, body, None)
        while not engine.running:  # the generation reached the engine
            await asyncio.sleep(0)
        return subscription

    async def release(tokens: int) -> None:
        engine.step(tokens)
        await settle(20)  # the service has taken them in before the reader asks

    with engine_loop() as (loop, on_loop):
        pieces = bridge.stream_text(on_loop(start()), loop, RuntimeError)
        for index in range(3):
            on_loop(release(1))
            assert next(pieces) == f"t{index} "
        on_loop(release(3))  # three tokens while the reader was elsewhere
        assert next(pieces) == "t3 t4 t5 "
        on_loop(release(2))
        assert next(pieces) == "t6 t7 "
        assert next(pieces, None) is None  # max_tokens reached: the stream ends
        on_loop(settle())  # the stream's own clean-up, handed to the loop as it ended


def test_missing_hook_is_reported(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(cog_cancel._hook_state, "warned", False)
    with caplog.at_level(logging.WARNING, logger="cog_cancel"):
        assert cog_cancel.current_cancel_signal(under_coglet=True) is None
    assert "will not abort the engine request" in caplog.text
    assert cog_cancel.current_cancel_signal(under_coglet=False) is None


# --- the cancel hook (cog/cog_cancel.py), as coglet 0.23.1 uses it: `result()` and `cancel()` ---------
async def _ctx_wrapper(coro: Any) -> Any:  # the name coglet 0.23.1 gives its wrapper
    return await coro


class Recorder:
    """A stand-in for run(): records the cancel signal it sees, then waits until let go."""

    def __init__(self) -> None:
        self.seen: list[cog_cancel.CancelSignal | None] = []
        self.go = threading.Event()

    async def run(self) -> str:
        self.seen.append(cog_cancel.current_cancel_signal(under_coglet=True))
        while not self.go.is_set():
            await asyncio.sleep(0.005)
        return "the generator"


def test_run_is_submitted_only_when_coglet_waits_on_it() -> None:
    runner = Recorder()
    with engine_loop() as (loop, on_loop):
        run = cog_cancel.submit_with_cancel_signal(_ctx_wrapper(runner.run()), loop)
        on_loop(settle())
        assert runner.seen == []  # coglet has the future; nothing runs yet
        runner.go.set()
        assert run.result() == "the generator"
        assert runner.seen == [run.signal] and not run.signal.fired


def test_a_cancel_before_coglet_waits_starts_nothing() -> None:
    runner = Recorder()
    with engine_loop() as (loop, on_loop):
        run = cog_cancel.submit_with_cancel_signal(_ctx_wrapper(runner.run()), loop)
        assert isinstance(run, cog_cancel.CogletRun)
        fired: list[str] = []
        run.signal.add(lambda: fired.append("left"))
        run.cancel()  # coglet's cancel, between storing the future and waiting on it
        with pytest.raises(concurrent.futures.CancelledError):
            run.result()
        on_loop(settle())
        assert runner.seen == [] and fired == ["left"]
        del run
        gc.collect()  # the unstarted coroutines are closed, not left to warn "never awaited"


def test_coglets_exception_injected_into_the_waiting_slot_thread_cancels_the_run() -> None:
    """Coglet injects CancelationException into the slot thread while it does not hold the future
    yet; raised inside `result()`, it cancels the run (whatever it opened is left through the
    signal) and coglet is told CancelledError, which it reports as "canceled"."""
    import ctypes

    from coglet import CancelationException

    runner = Recorder()
    outcome: list[BaseException | str] = []
    with engine_loop() as (loop, on_loop):
        run = cog_cancel.submit_with_cancel_signal(_ctx_wrapper(runner.run()), loop)
        fired: list[str] = []
        run.signal.add(lambda: fired.append("left"))

        def slot_thread() -> None:
            try:
                outcome.append(run.result())
            except BaseException as exc:
                outcome.append(exc)

        slot = threading.Thread(target=slot_thread)
        slot.start()
        while not runner.seen:  # run() runs: the slot thread waits in result()
            time.sleep(0.005)
        injected = ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(slot.ident or 0), ctypes.py_object(CancelationException)
        )
        assert injected == 1
        runner.go.set()  # run() returns: the slot thread wakes into Python, where it is raised
        slot.join(10)
    assert isinstance(outcome[0], concurrent.futures.CancelledError), outcome
    assert isinstance(outcome[0].__cause__, CancelationException)
    assert fired == ["left"] and run.signal.fired


@contextlib.contextmanager
def scripted_service() -> Iterator[
    tuple[ScriptedEngine, Service, asyncio.AbstractEventLoop, Callable[[Any], Any]]
]:
    engine = ScriptedEngine()
    with engine_loop() as (loop, on_loop):

        async def make() -> Service:
            return Service(Settings(), engine)

        yield engine, on_loop(make()), loop, on_loop


def _body(service: Service) -> Any:
    return cog_inputs.chat_request_from_inputs(service.settings, prompt="a b c", max_tokens=8)


def test_a_generation_opened_before_the_cancel_is_aborted_by_its_signal() -> None:
    """run() returning its generator after coglet cancelled it: nobody will read the generator,
    but the generation it opened is left when the signal fires (before or after it was opened)."""
    with scripted_service() as (engine, service, _, on_loop):
        for fired_first in (False, True):
            signal = cog_cancel.CancelSignal()
            if fired_first:
                signal.fire()
            on_loop(bridge.start_generation(service, _body(service), None, signal))
            on_loop(settle(20))
            assert len(engine.started) == 1 + fired_first
            if not fired_first:
                assert engine.aborted == []
                signal.fire()  # from coglet's thread
                on_loop(settle(20))
            assert engine.aborted == engine.started


def test_a_cancel_while_the_generation_is_opened_lets_the_open_finish_then_leaves_it() -> None:
    """Cut half-way, an open could leave a claim in the shared store with nothing behind it, or a
    generation nobody reads: the open runs to its end, and what it opened is left at once."""
    with scripted_service() as (engine, service, _, on_loop):
        opened = threading.Event()
        let_go = asyncio.Event()
        plain_open = service.open

        async def slow_open(*args: Any, **kwargs: Any) -> Any:
            subscription = await plain_open(*args, **kwargs)
            opened.set()
            await let_go.wait()  # an await inside the open, as the shared store's are
            return subscription

        service.open = slow_open  # type: ignore[method-assign]

        async def start_and_cancel() -> None:
            task = asyncio.ensure_future(bridge.start_generation(service, _body(service), "shared-id"))
            while not opened.is_set():
                await asyncio.sleep(0)
            task.cancel()  # coglet's cancel reaching run() at this await
            with contextlib.suppress(asyncio.CancelledError):
                await task
            assert engine.aborted == []  # the open is not cut: it finishes first
            let_go.set()
            await settle(20)

        on_loop(start_and_cancel())
        assert len(engine.started) == 1 and engine.aborted == engine.started  # named: no grace window


def test_a_text_stream_dropped_unread_leaves_its_generation() -> None:
    with scripted_service() as (engine, service, loop, on_loop):
        subscription = on_loop(bridge.start_generation(service, _body(service), None))
        pieces = bridge.stream_text(subscription, loop, RuntimeError)
        on_loop(settle(20))
        assert engine.aborted == []
        del pieces  # coglet failed the prediction before iterating it
        gc.collect()
        on_loop(settle(20))
        assert engine.aborted == engine.started


# --- the real Cog server ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cog_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CogServer]:
    limits = {"BUNDLE_MAX_MODEL_LEN": "2048", "BUNDLE_MAX_TOKENS_LIMIT": str(SERVER_LIMIT_MAX_TOKENS)}
    log_dir = tmp_path_factory.mktemp("cog")
    with running_cog_server(
        log_dir, runner=HOLD_RUNNER_REF, COG_MAX_CONCURRENCY=str(SLOTS), **limits
    ) as server:
        yield server


# Coglet 0.23.1 stayed up 37-42 s after its worker exited, until stopped (docs/cog.md).
COGLET_STAYS_UP_S = 5


def test_coglet_stays_up_and_unhealthy_when_its_worker_exits(tmp_path: Path) -> None:
    """Why the runner does NOT exit after engine death (docs/cog.md, "Engine death"): when its
    worker process exits, coglet 0.23.1 itself stays up, reports UNHEALTHY (the state a
    healthcheck returning False already gives; never DEFUNCT), fails the next prediction with an
    internal error, then answers 409 "at capacity" because that slot is gone for good; a SIGTERM
    still ends it with 0. No engine here: a stub runner whose worker exits when asked. If this
    fails after a Cog upgrade, coglet now does something else with an exited worker: re-measure
    and revisit the choice. Runs before the module's real server starts (file order)."""
    port = free_port()
    log_path = tmp_path / "server.log"
    stub = f"{ROOT / 'tests' / 'cog_exit_runner.py'}:Runner"
    process = launch(stub, port, log_path, tmp_path, {"COG_MAX_CONCURRENCY": "1"})
    server = CogServer(f"http://127.0.0.1:{port}", process, log_path, tmp_path / "unused.json")
    try:
        wait_ready(server, timeout=60)
        asked = httpx.post(f"{server.url}/predictions", json={"input": {"exit_code": 69}}, timeout=30)
        assert asked.json()["status"] == "succeeded"
        deadline = time.monotonic() + 30
        while (status := health_status(server.url)) == "READY" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert status == "UNHEALTHY"  # the stub's healthcheck passes: this is coglet's verdict
        with pytest.raises(subprocess.TimeoutExpired):
            process.wait(COGLET_STAYS_UP_S)  # no exit, so no exit code for a supervisor to act on
        after = httpx.post(f"{server.url}/predictions", json={"input": {}}, timeout=30)
        assert after.status_code == 200 and after.json()["status"] == "failed", after.text
        refused = httpx.post(f"{server.url}/predictions", json={"input": {}}, timeout=30)
        assert refused.status_code == 409, refused.text  # "at capacity": a dead slot, for good
        assert health_status(server.url) == "UNHEALTHY" and process.poll() is None
    finally:
        stop(process)
    assert process.returncode == 0, log_path.read_text()[-2000:]


def test_setup_reports_what_cancels_rely_on_of_coglet_in_one_line(cog_server: CogServer) -> None:
    """setup() checks coglet's internals (cog/coglet_internals.py) and says so in the setup log;
    the pinned coglet takes no fallback (tests/test_coglet_internals.py)."""
    lines = cog_server.log_path.read_text(errors="replace").splitlines()
    reported = [line for line in lines if "coglet internals:" in line]
    assert len(reported) == 1, reported
    assert "coglet.run_wrapper=_ctx_wrapper" in reported[0] and "fallback" not in reported[0]


def test_setup_warms_up_the_sampler_before_ready(cog_server: CogServer) -> None:
    """setup() runs the core's warm-up, sampled waves included, before coglet says READY: on the
    H200 the first 32-prediction wave otherwise waited ~7 s for vLLM's top-k/top-p Triton
    compile (docs/cog.md). What the waves put in the engine: tests/test_lifecycle.py."""
    lines = cog_server.log_path.read_text(errors="replace").splitlines()
    warmed = [i for i, line in enumerate(lines) if "warm-up done" in line and "sampled waves" in line]
    ready = [i for i, line in enumerate(lines) if "Setup complete" in line]
    assert warmed and ready and warmed[0] < ready[0], (warmed, ready)


def test_sse_streams_token_by_token(cog_server: CogServer) -> None:
    """Streamed, not collected and sent at the end: the first output reaches the client while the
    engine holds the rest of the generation (one output let through), so it cannot have ended.
    Released, the rest follows; every item the runner yielded is its own SSE event. How many
    items a stream has is not the code's to say (a reader that falls behind gets its backlog in
    one: tests/test_cog.py's scripted-engine test above); the joined text is."""
    holds, prediction = cog_server.held, "stream-token-by-token"
    holds.budget(prediction, 1)

    async def go() -> tuple[Stream, list[str], str | None]:
        async with httpx.AsyncClient(timeout=120) as client:
            stream = Stream()
            task = asyncio.create_task(
                sse_prediction(
                    client, cog_server.url, {**LONG, "seed": 1}, time.monotonic(), prediction, stream
                )
            )
            await asyncio.wait_for(stream.first_chunk.wait(), 120)
            first, ended = list(stream.chunks), holds.marker(prediction, "ended")
            holds.release(prediction)
            return await task, first, ended

    stream, first, ended_at_first_output = asyncio.run(go())
    assert ended_at_first_output is None  # the generation was held in the engine meanwhile
    assert len(first) == 1 and first[0]  # the one output the engine let through, alone
    assert stream.completed is not None and stream.completed["status"] == "succeeded"
    assert stream.chunks == stream.completed["output"]  # coglet neither merged nor split items
    assert stream.text.startswith(first[0]) and len(stream.text) > len(first[0])
    print(f"\nSSE: first output at {stream.first_output_after:.2f} s of {stream.duration:.2f} s")


def test_every_slot_streams_at_once_and_one_more_is_refused(cog_server: CogServer) -> None:
    """SLOTS predictions each get their first output while all of them are held in the engine:
    they stream side by side (an order of events, not a timing). Every slot is taken, so one more
    is refused with 409 at once; released, each ends with its whole text."""
    holds = cog_server.held
    predictions = [f"slot-{index}" for index in range(SLOTS)]
    for prediction in predictions:
        holds.budget(prediction, 1)

    async def go() -> tuple[list[Stream], int, list[str | None]]:
        clock = time.monotonic()
        async with httpx.AsyncClient(timeout=180) as client:
            streams = [Stream() for _ in predictions]
            tasks = [
                asyncio.create_task(
                    sse_prediction(client, cog_server.url, {**LONG, "seed": 10 + i}, clock, prediction, stream)
                )
                for i, (prediction, stream) in enumerate(zip(predictions, streams, strict=True))
            ]
            await asyncio.wait_for(asyncio.gather(*(s.first_chunk.wait() for s in streams)), 180)
            one_more = await client.post(
                f"{cog_server.url}/predictions", json={"input": {"prompt": "one more", "max_tokens": 5}}
            )
            ended = [holds.marker(prediction, "ended") for prediction in predictions]
            for prediction in predictions:
                holds.release(prediction)
            return list(await asyncio.gather(*tasks)), one_more.status_code, ended

    streams, one_more_status, ended_while_all_streamed = asyncio.run(go())
    assert ended_while_all_streamed == [None] * SLOTS
    assert one_more_status == 409, "every slot was busy: coglet refuses at once"
    for stream in streams:
        assert stream.completed is not None and stream.completed["status"] == "succeeded"
        assert stream.chunks == stream.completed["output"]  # nothing lost, merged or split
    print("\n" + "; ".join(f"first {s.first_output_after:.2f}/{s.duration:.2f} s" for s in streams))


def test_cancel_leaves_no_running_engine_request(cog_server: CogServer) -> None:
    """A cancel mid-stream (the generation held in the engine after its first outputs, so it is
    surely running) aborts the engine request: the runner's generation ends "aborted" (held, it
    could not have finished), the prediction is "canceled", and vLLM's own count returns to 0."""
    holds, prediction = cog_server.held, "cancel-mid-stream"
    holds.budget(prediction, 3)

    async def go() -> tuple[Stream, int, float]:
        async with httpx.AsyncClient(timeout=120) as client:
            stream = Stream()
            inputs = {**LONG, "max_tokens": SERVER_LIMIT_MAX_TOKENS, "seed": 5}
            task = asyncio.create_task(
                sse_prediction(client, cog_server.url, inputs, time.monotonic(), prediction, stream)
            )
            await asyncio.wait_for(stream.first_chunk.wait(), 120)
            cancelled_at = time.time()
            response = await client.post(f"{cog_server.url}/predictions/{prediction}/cancel")
            return await task, response.status_code, cancelled_at

    stream, cancel_status, cancelled_at = asyncio.run(go())
    assert cancel_status == 200
    assert stream.completed is not None and stream.completed["status"] == "canceled"
    assert holds.wait_for(prediction, "ended") == "aborted"
    assert holds.marker(prediction, "cancel-seen") is not None
    left_after = holds.marked_at(prediction, "ended") - cancelled_at
    waited = asyncio.run(_engine_idle(cog_server))
    assert stream.text == "".join(stream.completed.get("output") or [])
    print(
        f"\ncancel: the generation left the engine {left_after:.2f} s after it; vLLM idle after {waited:.2f} s"
    )


async def _engine_idle(server: CogServer, within_s: float = 30) -> float:
    """Seconds until vLLM's own count of running requests (the runner's stats file) reads 0."""
    started = time.monotonic()
    await until(lambda: server.engine_running_requests() == 0, within_s, "vLLM holds no request")
    return time.monotonic() - started


def test_out_of_range_input_is_422_before_the_runner(cog_server: CogServer) -> None:
    bad_inputs = (
        {"max_tokens": 0},
        {"temperature": 2.5},
        {"top_p": 0},  # the core takes top_p > 0 only
        {"top_p": -1},
        {"request_id": "x" * 300},
    )
    for bad in bad_inputs:
        response = httpx.post(
            f"{cog_server.url}/predictions", json={"input": {"prompt": "hi", **bad}}, timeout=30
        )
        assert response.status_code == 422, (bad, response.text)
        assert response.json()["detail"][0]["loc"][-1] == next(iter(bad))
    missing = httpx.post(f"{cog_server.url}/predictions", json={"input": {}}, timeout=30)
    assert missing.status_code == 422
    # Nothing reached the runner: no prediction was admitted, the engine holds nothing.
    assert probe(cog_server.url)["metrics"]["engine_running_requests"] == 0


def test_core_rejections_are_failed_predictions_with_the_reason(cog_server: CogServer) -> None:
    # Within the schema's bound (4096) but above this server's BUNDLE_MAX_TOKENS_LIMIT: this
    # also proves that BUNDLE_* settings reach the runner inside coglet's worker.
    body = httpx.post(
        f"{cog_server.url}/predictions",
        json={"input": {"prompt": "hi", "max_tokens": SERVER_LIMIT_MAX_TOKENS + 1}},
        timeout=30,
    ).json()
    assert body["status"] == "failed"
    assert f"limit of {SERVER_LIMIT_MAX_TOKENS}" in body["error"]
    body = httpx.post(
        f"{cog_server.url}/predictions", json={"input": {"prompt": "hi " * 3000}}, timeout=30
    ).json()
    assert body["status"] == "failed" and "context" in body["error"]


def test_same_request_id_follows_the_same_generation(cog_server: CogServer) -> None:
    inputs = {"prompt": "dedup", "max_tokens": 40, "temperature": 1.0, "request_id": "same-1"}
    outputs = [
        httpx.post(f"{cog_server.url}/predictions", json={"input": inputs}, timeout=60).json() for _ in range(2)
    ]
    assert [o["status"] for o in outputs] == ["succeeded", "succeeded"]
    texts = ["".join(o["output"]) for o in outputs]
    assert texts[0] == texts[1]  # unseeded sampling: the same text means one generation


def test_core_client_reads_the_cog_server_stream(cog_server: CogServer) -> None:
    from bundle_client.client import ResumableClient

    async def go() -> str:
        async with ResumableClient(cog_server.url) as client:
            pieces = [p async for p in client.stream_prediction({**LONG, "max_tokens": 40, "seed": 3})]
        return "".join(pieces)

    streamed = asyncio.run(go())
    whole = httpx.post(
        f"{cog_server.url}/predictions",
        json={"input": {**LONG, "max_tokens": 40, "seed": 3}},
        timeout=60,
    ).json()
    assert streamed and streamed == "".join(whole["output"])


def test_dead_engine_is_unhealthy_and_fails_predictions(cog_server: CogServer) -> None:
    """Last on purpose: it kills the module's engine, under a prediction that is streaming (held
    in the frozen engine by the gate, so vLLM holds it when its core dies)."""
    assert health_status(cog_server.url) == "READY"
    inputs = {**LONG, "max_tokens": SERVER_LIMIT_MAX_TOKENS, "seed": 7}
    in_flight, running_at_kill = asyncio.run(engine_killed_under_a_prediction(cog_server, inputs))
    assert running_at_kill == 1, "the engine did not hold the stream when it was killed"
    # The stream that was running ends as a failed prediction carrying the engine's reason.
    assert in_flight.completed is not None, in_flight
    assert in_flight.completed["status"] == "failed", in_flight.completed
    assert "the engine died" in in_flight.completed["error"]
    assert health_status(cog_server.url) == "UNHEALTHY"
    body = httpx.post(
        f"{cog_server.url}/predictions",
        json={"input": {"prompt": "hi", "max_tokens": 5}},
        timeout=30,
    ).json()
    assert body["status"] == "failed" and "engine" in body.get("error", ""), body
    # The chosen behaviour under coglet (docs/cog.md, "Engine death"): the runner does not exit,
    # since coglet would stay up anyway and answer with internal errors, then 409s (see
    # test_coglet_stays_up_and_unhealthy_when_its_worker_exits); it keeps saying why instead.
    assert cog_server.process.poll() is None
    assert health_status(cog_server.url) == "UNHEALTHY"


async def _two_readers_of_one_generation(engine: ScriptedEngine, request_id: str) -> tuple[Any, Any]:
    """Two predictions with one request_id on the scripted engine, once it runs the one generation."""
    service = Service(Settings(), engine)
    body = cog_inputs.chat_request_from_inputs(service.settings, prompt="a b c", max_tokens=4)
    first = await bridge.start_generation(service, body, request_id)
    second = await bridge.start_generation(service, body, request_id)
    while not engine.running:
        await asyncio.sleep(0)
    return first, second


async def _step(engine: ScriptedEngine, tokens: int) -> None:
    engine.step(tokens)
    await settle(20)


def _two_text_streams(
    engine: ScriptedEngine,
    loop: asyncio.AbstractEventLoop,
    on_loop: Callable[[Any], Any],
    request_id: str,
    second_cancelled: Callable[[], BaseException],
) -> tuple[Iterator[str], Iterator[str], bridge.CancelSignal]:
    """Two predictions' text streams over one generation (one request_id), both past the shared
    first token; the second's cancel signal, for the test to fire."""
    first, second = on_loop(_two_readers_of_one_generation(engine, request_id))
    signals = bridge.CancelSignal(), bridge.CancelSignal()
    kept = bridge.stream_text(first, loop, RuntimeError, signals[0])
    other = bridge.stream_text(second, loop, second_cancelled, signals[1])
    on_loop(_step(engine, 1))
    assert next(kept) == next(other) == "t0 "
    return kept, other, signals[1]


class FollowerCancelled(Exception):
    """What the test's `cancelled()` builds (the runner passes Cog's CancelationException)."""


def test_a_cancelled_follower_stops_waiting_at_once() -> None:
    """A prediction reading a generation another prediction started (one request_id) does not
    own it: cancelling it must end its wait now, not when the generation next emits or ends
    (its slot thread was blocked until then), and must leave the generation to the other."""
    engine = ScriptedEngine()

    with engine_loop() as (loop, on_loop), concurrent.futures.ThreadPoolExecutor(1) as slot:
        kept, follower, follower_signal = _two_text_streams(
            engine, loop, on_loop, "follower-id", FollowerCancelled
        )
        waiting = slot.submit(next, follower)  # no engine step comes: it blocks
        try:
            with pytest.raises(concurrent.futures.TimeoutError):
                waiting.result(timeout=0.3)
            follower_signal.fire()
            with pytest.raises(FollowerCancelled):
                waiting.result(timeout=10)
        finally:
            on_loop(_step(engine, 3))  # the generation ends: a wait still blocked returns, the test ends
        assert "".join(kept) == "t1 t2 t3 "
        assert engine.aborted == [] and len(engine.started) == 1


@pytest.mark.timeout(20)
def test_cancelling_one_of_two_predictions_with_one_request_id_leaves_the_other_running() -> None:
    """Two predictions that share a `request_id` read one generation; a cancel of one is that
    reader leaving (as on the HTTP path), not an abort of the generation the other still reads.
    The last reader's cancel does abort it."""
    engine = ScriptedEngine()

    with engine_loop() as (loop, on_loop):
        kept, cancelled, cancelled_signal = _two_text_streams(engine, loop, on_loop, "shared-id", RuntimeError)
        cancelled_signal.fire()
        cancelled.close()
        on_loop(_step(engine, 3))
        assert "".join(kept) == "t1 t2 t3 "  # the whole answer, not "canceled"
        assert engine.aborted == [] and len(engine.started) == 1

        async def start_one() -> Any:
            service = Service(Settings(), engine)
            body = cog_inputs.chat_request_from_inputs(service.settings, prompt="a b", max_tokens=4)
            return await bridge.start_generation(service, body, "alone")

        alone, its_signal = on_loop(start_one()), bridge.CancelSignal()
        pieces = bridge.stream_text(alone, loop, RuntimeError, its_signal)
        on_loop(_step(engine, 1))
        assert next(pieces) == "t0 "
        its_signal.fire()
        on_loop(settle(20))
        assert engine.aborted == [engine.started[-1]]  # its only reader left: aborted at once
        pieces.close()
        on_loop(settle())
