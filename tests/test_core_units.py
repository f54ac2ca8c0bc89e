"""Fast unit tests of the core's own logic, no vLLM: the registry behind `Service` (dedup,
conflict, grace, eviction, cancel, admission), the replay buffer (resume points, trimming, slow
readers) and the chunk encoder. The engine is `ScriptedEngine` (tests/scripted.py), which emits
exactly the tokens a test releases; behaviour end to end is tested on the real engine elsewhere."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from shared.engine.vllm import _finish_reason
from shared.errors import (
    EngineUnavailable,
    EventsGone,
    GenerationFailed,
    IdempotencyConflict,
    InvalidRequest,
    NotFound,
    Overloaded,
)
from shared.generation.replay import ReplayBuffer
from shared.schemas import ChatCompletionRequest, CompletionRequest, parse_request
from shared.service import Service, Subscription
from shared.settings import Settings
from shared.streaming import ChunkEncoder, Usage, sse_data, sse_event

from .scripted import ScriptedEngine, settle

pytestmark = pytest.mark.timeout(20)  # milliseconds each; a hang is a bug, not a slow machine


def chat(**extra: Any) -> ChatCompletionRequest:
    messages = [{"role": "user", "content": "a b c"}]
    body = {"model": "tiny", "messages": messages, "stream": True, "max_tokens": 8}
    return parse_request(ChatCompletionRequest, {**body, **extra})


def make_service(engine: ScriptedEngine | None = None, **overrides: Any) -> tuple[Service, ScriptedEngine]:
    engine = engine or ScriptedEngine()
    return Service(Settings(**overrides), engine), engine


async def drain(events: AsyncIterator[bytes]) -> bytes:
    return b"".join([chunk async for chunk in events])


def event_ids(raw: bytes) -> list[int]:
    return [int(line[4:]) for line in raw.split(b"\n") if line.startswith(b"id: ")]


# --- registry behind Service ---------------------------------------------------------------------
async def test_same_id_and_body_share_one_generation_and_identical_events() -> None:
    service, engine = make_service(engine=ScriptedEngine(auto=True))
    first = await service.open("chat", chat(), "one")
    second = await service.open("chat", chat(), "one")
    a, b = await asyncio.gather(drain(first.events()), drain(second.events()))
    assert a == b and b"[DONE]" in a
    assert len(engine.started) == 1
    replay = await service.open("chat", chat(), "one")  # after the end: the stored result
    assert await drain(replay.events()) == a
    assert len(engine.started) == 1


async def test_same_id_with_another_body_is_a_conflict() -> None:
    service, _ = make_service()
    (await service.open("chat", chat(), "x")).close()
    with pytest.raises(IdempotencyConflict):
        await service.open("chat", chat(temperature=0.5), "x")
    with pytest.raises(IdempotencyConflict):
        completion = parse_request(CompletionRequest, {"model": "tiny", "prompt": "a"})
        await service.open("completion", completion, "x")


async def test_an_anonymous_reader_leaving_aborts_at_once() -> None:
    service, engine = make_service()
    subscription = await service.open("chat", chat())
    await settle()
    assert len(engine.running) == 1
    subscription.close()
    await settle()
    assert engine.running == {} and len(engine.aborted) == 1
    assert service.metrics.aborted_requests.labels("disconnect")._value.get() == 1


async def test_a_named_reader_leaving_starts_the_grace_window_and_a_return_cancels_it() -> None:
    service, engine = make_service(disconnect_grace_s=0.0)  # fires on the next loop turn
    (await service.open("chat", chat(), "g")).close()
    back = await service.open("chat", chat(), "g", last_event_id=0)  # before the timer ran: cancelled
    await settle()
    assert len(engine.running) == 1
    back.close()
    await settle()
    assert engine.running == {}
    assert service.metrics.aborted_requests.labels("grace_expired")._value.get() == 1


async def test_attached_readers_keep_a_named_generation_alive() -> None:
    service, engine = make_service(disconnect_grace_s=0.0)
    first = await service.open("chat", chat(), "two-readers")
    second = await service.open("chat", chat(), "two-readers")
    first.close()
    await settle()
    assert len(engine.running) == 1  # one reader is left
    second.close()
    await settle()
    assert engine.running == {}


async def test_resume_needs_an_id_and_a_held_stream() -> None:
    service, _ = make_service()
    with pytest.raises(InvalidRequest):
        await service.open("chat", chat(), None, last_event_id=3)
    with pytest.raises(EventsGone):
        await service.open("chat", chat(), "never-seen", last_event_id=3)


async def test_finished_results_are_evicted_oldest_first_beyond_the_cap() -> None:
    service, _ = make_service(ScriptedEngine(auto=True), max_held_requests=2)
    for name in ("r1", "r2", "r3"):
        await drain((await service.open("chat", chat(), name)).events())
    await settle()
    with pytest.raises(EventsGone):
        await service.open("chat", chat(), "r1", last_event_id=0)
    assert await drain((await service.open("chat", chat(), "r3", last_event_id=0)).events())
    assert service.stats()["held_requests"] == 2


async def test_finished_results_expire_after_retention() -> None:
    service, _ = make_service(ScriptedEngine(auto=True), retention_s=0.0)
    await drain((await service.open("chat", chat(), "short")).events())
    await settle()
    with pytest.raises(EventsGone):
        await service.open("chat", chat(), "short", last_event_id=0)


async def test_cancel_ends_attached_streams_and_says_what_happened() -> None:
    service, engine = make_service()
    reader = await service.open("chat", chat(), "c")
    collected = asyncio.create_task(drain(reader.events()))
    await settle()
    engine.step(2)
    outcome = await service.cancel("c")
    assert outcome.status == "cancelled"
    raw = await collected
    assert b'"code":"request_cancelled"' in raw and raw.endswith(b"data: [DONE]\n\n")
    assert (await service.cancel("c")).status == "cancelled"  # idempotent
    with pytest.raises(NotFound):
        await service.cancel("unknown")

    done = await service.open("chat", chat(), "finished")
    await settle()
    engine.step(8)
    await drain(done.events())
    assert (await service.cancel("finished")).status == "completed"


async def test_a_cancel_before_the_generation_first_ran_ends_it_and_frees_its_slot() -> None:
    # On Python 3.11 (no eager task start) the generation's task has not run yet when the open
    # returns; a cancel in the same loop turn cancels a coroutine that never started. Its readers
    # must still get their end and its slot must be freed (3.12 starts it eagerly: same outcome).
    service, _ = make_service(max_in_flight=1)
    reader = await service.open("chat", chat(), "early")
    outcome = await service.cancel("early")
    assert outcome.status == "cancelled"
    raw = await asyncio.wait_for(drain(reader.events()), timeout=5)
    assert b'"code":"request_cancelled"' in raw and raw.endswith(b"data: [DONE]\n\n")
    assert service.stats()["running_generations"] == 0
    again = await service.open("chat", chat(), "after")  # the one slot is free again
    again.close()


async def test_admission_beyond_the_in_flight_cap_is_429_and_starts_nothing() -> None:
    service, engine = make_service(max_in_flight=2)
    held = [await service.open("chat", chat()) for _ in range(2)]
    with pytest.raises(Overloaded):
        await service.open("chat", chat())
    await settle()
    assert len(engine.started) == 2
    for subscription in held:
        subscription.close()


async def test_text_readers_get_every_piece_once_and_the_whole_body() -> None:
    service, engine = make_service()
    subscription: Subscription = await service.open("chat", chat(stream=False), "text")
    pieces = subscription.text()
    engine_task = asyncio.create_task(_release(engine, 8))
    text = "".join([piece async for piece in pieces])
    await engine_task
    assert text == "".join(f"t{i} " for i in range(8))
    body = await subscription.response()
    assert body["choices"][0]["message"]["content"] == text
    assert body["usage"]["completion_tokens"] == 8
    subscription.close()


async def test_a_short_prompt_over_the_token_limit_is_refused_at_open() -> None:
    service, engine = make_service(max_prompt_tokens=3)
    with pytest.raises(InvalidRequest, match="tokens"):
        await service.open("chat", chat(messages=[{"role": "user", "content": "w " * 10}]))
    assert engine.started == []


async def test_a_long_prompt_refused_after_rendering_is_an_error_before_any_event() -> None:
    service, engine = make_service(max_prompt_tokens=200)  # within the character bound, over the token one
    subscription = await service.open("chat", chat(messages=[{"role": "user", "content": "w " * 2500}]))
    with pytest.raises(InvalidRequest, match="tokens"):
        await subscription.admitted()
    subscription.close()
    assert engine.started == []  # never reached the engine


async def test_an_oversized_prompt_is_refused_before_tokenizing() -> None:
    service, engine = make_service(max_prompt_tokens=10)
    with pytest.raises(InvalidRequest, match="characters"):
        await service.open("chat", chat(messages=[{"role": "user", "content": "x" * 1000}]))
    assert engine.tokenized_on == []


async def test_long_prompts_are_tokenized_off_the_event_loop() -> None:
    service, engine = make_service()
    short = await service.open("chat", chat())
    await short.admitted()
    long = await service.open("chat", chat(messages=[{"role": "user", "content": "word " * 2000}]))
    await long.admitted()
    loop_thread = threading.current_thread().name
    assert engine.tokenized_on[0] == loop_thread  # cheaper inline than a thread hop
    assert engine.tokenized_on[1] != loop_thread
    short.close()
    long.close()


async def _release(engine: ScriptedEngine, tokens: int) -> None:
    for _ in range(tokens):
        await settle()
        engine.step(1)


# --- replay buffer ------------------------------------------------------------------------------
async def test_follow_from_any_resume_point_gives_the_rest_exactly_once() -> None:
    buffer = ReplayBuffer(max_events=100, numbered=True)
    for index in range(10):
        buffer.append(b"%d" % index)
    buffer.close()
    for after in (0, 4, 9, 10):
        assert event_ids(await drain(buffer.follow(after))) == list(range(after + 1, 11))


async def test_an_unnumbered_buffer_frames_plain_data_events_and_still_counts_them() -> None:
    buffer = ReplayBuffer(max_events=100, numbered=False)
    for index in range(5):
        buffer.append(b"%d" % index)
    buffer.close()
    assert await drain(buffer.follow(0)) == b"".join(sse_data(b"%d" % i) for i in range(5))
    assert await drain(buffer.follow(3)) == sse_data(b"3") + sse_data(b"4")  # the cursor still counts


async def test_resume_points_outside_the_held_range_are_refused() -> None:
    buffer = ReplayBuffer(max_events=16, numbered=True)
    for index in range(40):
        buffer.append(b"%d" % index)
    assert buffer.first_sequence > 1 and buffer.held_events() <= 16
    with pytest.raises(EventsGone):
        buffer.check_resumable(0)
    buffer.check_resumable(buffer.first_sequence - 1)  # exactly the oldest held: fine
    buffer.check_resumable(40)  # the last event sent: nothing to replay, live from here
    with pytest.raises(InvalidRequest):  # no client can have seen event 41 of a running stream
        buffer.check_resumable(41)
    buffer.close()
    with pytest.raises(InvalidRequest):
        buffer.check_resumable(500)


async def test_a_live_reader_gets_events_as_they_come_and_stops_at_close() -> None:
    buffer = ReplayBuffer(max_events=100, numbered=True)
    received: list[bytes] = []

    async def read() -> None:
        async for chunk in buffer.follow(0):
            received.append(chunk)

    reader = asyncio.create_task(read())
    await settle()
    buffer.append(b"a")
    await settle()
    assert received == [sse_event(1, b"a")]
    buffer.append(b"b")
    buffer.append(b"c")
    buffer.close()
    await reader
    assert received[1] == sse_event(2, b"b") + sse_event(3, b"c")  # a backlog comes in one write


async def _live_writes(buffer: ReplayBuffer, events_per_write: int, appends: int) -> list[list[int]]:
    """Append `appends` events one loop turn apart to a reader paced at `events_per_write`, close,
    and return the event ids of each write the reader made."""
    writes: list[list[int]] = []

    async def read() -> None:
        async for chunk in buffer.follow(0, events_per_write=lambda: events_per_write):
            writes.append(event_ids(chunk))

    reader = asyncio.create_task(read())
    await settle()
    for index in range(appends):
        buffer.append(b"%d" % index)
        await settle()
    buffer.close()
    await reader
    return writes


async def test_under_stream_load_an_engine_that_paces_each_request_is_asked_for_pairs() -> None:
    """With `stream_batch_at`, a generation admitted while that many already run gets its
    tokens in pairs: from the engine itself where it can (vLLM's per-request stream interval),
    else by the bundle's paired writes. Below the threshold, every token as it is made."""
    pacing = ScriptedEngine()
    pacing.paces_each_request = True
    service, engine = make_service(pacing, stream_batch_at=2)
    assert not service.pacing.pairs_writes  # the engine paces: the writes are not held as well
    # Counted as they are admitted: a burst's third request already sees two running.
    readers = [await service.open("chat", chat()) for _ in range(4)]
    await settle()
    assert [request.stream_interval for request in engine.requests] == [None, None, 2, 2]
    engine.auto = True
    engine.step(8)
    await asyncio.gather(*(drain(reader.events()) for reader in readers))
    assert service.registry.running == 0
    alone = await service.open("chat", chat())  # the load gone, every token again
    await drain(alone.events())
    assert len(engine.requests) == 5 and engine.requests[-1].stream_interval is None

    service, engine = make_service(stream_batch_at=2)  # an engine that cannot pace requests
    assert service.pacing.pairs_writes and service.pacing.events_per_write() == 1
    readers = [await service.open("chat", chat()) for _ in range(3)]
    await settle()
    assert service.pacing.events_per_write() == 2 and {r.stream_interval for r in engine.requests} == {None}
    engine.auto = True
    engine.step(8)
    await asyncio.gather(*(drain(reader.events()) for reader in readers))
    assert service.pacing.events_per_write() == 1
    assert not make_service()[0].pacing.pairs_writes  # unset: neither


async def test_a_paced_reader_writes_events_in_pairs_after_the_first_two_and_nothing_waits_at_the_end() -> None:
    """Under load (BUNDLE_STREAM_BATCH_AT) a reader wakes once per two events, but never for
    a stream's first two (the first token is not held), and the end flushes an odd one out."""
    writes = await _live_writes(ReplayBuffer(max_events=100, numbered=True), 2, appends=7)
    assert writes == [[1], [2], [3, 4], [5, 6], [7]]
    assert await _live_writes(ReplayBuffer(max_events=100, numbered=True), 1, appends=4) == [[1], [2], [3], [4]]


async def test_readers_of_one_stream_asking_for_different_pacing_are_woken_for_the_earliest() -> None:
    buffer = ReplayBuffer(max_events=100, numbered=True)
    for index in range(3):
        buffer.append(b"%d" % index)
    paced, eager = buffer.follow(0, events_per_write=lambda: 2), buffer.follow(0)
    assert event_ids(await anext(paced)) == event_ids(await anext(eager)) == [1, 2, 3]
    waits = asyncio.gather(anext(paced), anext(eager))
    await settle()
    buffer.append(b"3")  # one event: enough for the unpaced reader, so both wake and write it
    assert [event_ids(chunk) for chunk in await waits] == [[4], [4]]
    buffer.close()


async def test_a_reader_that_falls_behind_the_buffer_gets_an_error_not_a_gap() -> None:
    buffer = ReplayBuffer(max_events=16, numbered=True)
    buffer.append(b"first")
    follower = buffer.follow(0)
    assert await anext(follower) == sse_event(1, b"first")
    for index in range(64):  # the reader sleeps while the buffer drops what it has not read
        buffer.append(b"%d" % index)
    tail = await anext(follower)
    assert b'"code":"events_gone"' in tail and tail.endswith(b"data: [DONE]\n\n")
    assert b"id:" not in tail  # nothing in it may be resumed from
    with pytest.raises(StopAsyncIteration):
        await anext(follower)


# --- encoder -------------------------------------------------------------------------------------
def test_chat_chunks_are_openai_shaped_and_escape_text() -> None:
    encoder = ChunkEncoder("chat", "chatcmpl-1", "tiny")
    opening = orjson.loads(encoder.opening() or b"")
    assert opening["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    chunk = orjson.loads(encoder.text('say "hi"\n\u00e9', None))
    assert chunk["object"] == "chat.completion.chunk" and chunk["id"] == "chatcmpl-1"
    assert chunk["choices"] == [
        {"index": 0, "delta": {"content": 'say "hi"\n\u00e9'}, "logprobs": None, "finish_reason": None}
    ]
    last = orjson.loads(encoder.text("", "length"))
    assert last["choices"][0]["finish_reason"] == "length"
    usage = orjson.loads(encoder.usage(Usage(3, 4)))
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
    }


def test_completion_chunks_and_whole_responses() -> None:
    encoder = ChunkEncoder("completion", "cmpl-1", "tiny")
    assert encoder.opening() is None
    chunk = orjson.loads(encoder.text("x", "stop"))
    assert chunk["object"] == "text_completion"
    assert chunk["choices"][0] == {"index": 0, "text": "x", "logprobs": None, "finish_reason": "stop"}
    body = encoder.response("xyz", "stop", Usage(1, 3))
    assert body["choices"][0]["text"] == "xyz" and body["usage"]["total_tokens"] == 4
    chat_body = ChunkEncoder("chat", "c", "tiny").response("hey", "length", Usage(1, 1))
    assert chat_body["choices"][0]["message"] == {"role": "assistant", "content": "hey"}


def test_a_failing_engine_gauge_reads_nan_and_the_other_metrics_still_export() -> None:
    from shared.obs.metrics import Metrics

    def broken() -> int:
        raise AttributeError("'AsyncLLM' object has no attribute 'get_num_unfinished_requests'")

    metrics = Metrics()
    metrics.watch_engine(broken)
    metrics.generation_tokens.inc(3)
    text = metrics.exposition().decode()
    assert "bundle_engine_running_requests NaN" in text
    assert "bundle_generation_tokens_total 3.0" in text


def test_the_lock_free_metrics_expose_exactly_what_prometheus_clients_own_do() -> None:
    """The per-token counter and histogram (shared/obs/loop_metrics.py) against prometheus_client's
    Counter and Histogram fed the same values: the same /metrics text, bar the creation times.
    The values sit on, between, below and above the bounds."""
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    from shared.obs.loop_metrics import LoopCounter, LoopHistogram

    bounds = (0.001, 0.0025, 0.01, 1, 2.5)
    values = [0.0, 0.0005, 0.001, 0.002, 0.0025, 0.3, 1.0, 2.5, 2.6, 1e9, 0.001]

    def exposition(counter_type: Any, histogram_type: Any) -> list[str]:
        registry = CollectorRegistry()
        counter = counter_type("c", "a counter", registry=registry)
        histogram = histogram_type("h_seconds", "a histogram", buckets=bounds, registry=registry)
        for value in values:
            counter.inc(3)
            histogram.observe(value)
        counter.inc()
        lines = generate_latest(registry).decode().splitlines()
        return [line for line in lines if not line.startswith(("c_created ", "h_seconds_created "))]

    ours = exposition(LoopCounter, LoopHistogram)
    assert ours == exposition(Counter, Histogram)
    assert "c_total 34.0" in ours and 'h_seconds_bucket{le="0.001"} 4.0' in ours
    with pytest.raises(ValueError):
        LoopCounter("d", "another", registry=CollectorRegistry()).inc(-1)


def test_the_send_wrappers_a_stream_body_skips_are_the_ones_that_only_watch_its_start() -> None:
    """EventStreamResponse writes body chunks to the server's own send, past the app's
    middleware (shared/http/api.py says why). That is sound only while every middleware between
    them passes body messages on unchanged: one that rewrites bodies (compression, say) added
    here would silently miss every stream, so adding any middleware must come through here."""
    from fastapi.middleware.asyncexitstack import AsyncExitStackMiddleware
    from starlette.middleware.errors import ServerErrorMiddleware
    from starlette.middleware.exceptions import ExceptionMiddleware

    from shared.http.api import BearerAuth, create_app
    from shared.http.headers import HeaderGuard
    from shared.http.telemetry import RequestTelemetry

    app = create_app(Settings(api_key="k"), engine=ScriptedEngine())
    layer: Any = app.build_middleware_stack()
    layers = []
    while layer is not app.router:
        layers.append(type(layer))
        layer = layer.app
    # AsyncExitStackMiddleware does not wrap send at all; FastAPI adds it inside its handlers.
    # RequestTelemetry reads the status of `http.response.start` and passes every message on.
    expected = [
        ServerErrorMiddleware,
        RequestTelemetry,
        HeaderGuard,
        BearerAuth,
        ExceptionMiddleware,
        AsyncExitStackMiddleware,
    ]
    assert layers == expected


def test_access_log_is_a_setting_and_a_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    """The benchmark runs the bundle without uvicorn's access log, as it runs vLLM's server
    (`--no-access-log`); a plain start keeps it."""
    from fastapi import FastAPI

    from shared import serve
    from shared.http import process

    started: list[Settings] = []
    monkeypatch.setattr(serve, "serve", started.append)
    serve.main(["--no-access-log"])
    serve.main([])
    assert [s.access_log for s in started] == [False, True]

    configs: list[Any] = []
    monkeypatch.setattr(process.DrainingServer, "run", lambda server: configs.append(server.config))
    for settings in started:
        assert process.run_server(settings, lambda request_exit: FastAPI()) == 0
    assert [c.access_log for c in configs] == [False, True]


async def test_loop_lag_records_how_long_the_loop_was_held() -> None:
    """A loop held for 1 s (a blocking call on it) shows as one lag sample of about that; the
    turns before it, a few milliseconds late at most, stay far below. Samples are counted, not
    waited for by the clock: the loop is held once three have been taken, and the watcher is
    stopped once it has taken the held one."""
    import time

    from prometheus_client import CollectorRegistry, Histogram

    from shared.obs.loop_lag import watch_loop_lag

    held_s, small_s = 1.0, 0.5  # a free turn late by half a second would be a loop stall itself
    lag = Histogram("lag", "test", buckets=(0.01, small_s), registry=CollectorRegistry())

    def samples() -> dict[str, float]:
        found = {s.labels["le"]: s.value for s in lag.collect()[0].samples if s.name == "lag_bucket"}
        return {**found, "count": found["+Inf"]}

    async def until_counted(count: float) -> None:
        async with asyncio.timeout(60):
            while samples()["count"] < count:
                await asyncio.sleep(0.01)

    watcher = asyncio.create_task(watch_loop_lag(lag, interval_s=0.02))
    await until_counted(3)
    free = samples()["count"]
    time.sleep(held_s)  # noqa: ASYNC251 - on purpose: holds the loop, as a CPU-heavy request would
    await until_counted(free + 1)
    watcher.cancel()
    counted = samples()
    assert counted["+Inf"] - counted[str(small_s)] >= 1  # the held turn: a sample above
    assert counted[str(small_s)] >= 3  # the free turns before it: small


def test_engine_output_timings_wait_and_handling() -> None:
    from shared.obs.engine_outputs import OutputTimings, time_engine_outputs

    timings = OutputTimings()
    timings.asking_again(1.0)  # nothing taken up yet: no handling to count
    timings.taken(stamped_at=10.0, now=10.5)
    timings.asking_again(11.25)
    timings.taken(stamped_at=0.0, now=12.0)  # no stamp (another vLLM): no wait counted
    assert (timings.wait.count, timings.wait.seconds) == (1, 0.5)
    assert (timings.handling.count, timings.handling.seconds) == (1, 0.75)
    untouched = time_engine_outputs(object())  # an engine client without the hook is left alone
    assert untouched.wait.count == untouched.handling.count == 0


def test_vllm_finish_reasons_that_are_failures_are_never_reported_as_a_finish() -> None:
    # "abort" is also made by the real engine in tests/test_shutdown.py; vLLM's "error" (a KV-cache
    # load failure, say) cannot be produced on demand by the CPU engine, hence this unit test.
    reasons = (None, "length", "stop", "repetition")
    assert [_finish_reason(r) for r in reasons] == [None, "length", "stop", "stop"]
    with pytest.raises(EngineUnavailable, match="aborted"):
        _finish_reason("abort")
    with pytest.raises(GenerationFailed, match="new X-Request-Id"):
        _finish_reason("error")


async def test_a_stream_whose_request_task_is_cancelled_closes_its_body_and_tasks() -> None:
    # A host may cancel the request's task mid-stream (Modal's ASGI wrapper, when it cancels an
    # input) while a write is stuck in a queue nobody reads: the body (the subscription) must be
    # closed and no task left behind, or the generation and its reader count leak.
    from shared.http.api import EventStreamResponse

    closed = asyncio.Event()

    async def body() -> AsyncIterator[bytes]:
        try:
            while True:
                yield b"data: {}\n\n"
                await asyncio.sleep(0)
        finally:
            closed.set()

    stuck = asyncio.Event()

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            stuck.set()
            await asyncio.Event().wait()  # a write nobody will ever take

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()
        return {}

    before = asyncio.all_tasks()
    response = EventStreamResponse(body())
    serving = asyncio.create_task(response({"type": "http"}, receive, send))
    await asyncio.wait_for(stuck.wait(), 5)
    serving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await serving
    await asyncio.wait_for(closed.wait(), 5)
    assert asyncio.all_tasks() - before == {asyncio.current_task()} - before


# --- direct writes (a caught-up reader's events put on its connection by `append`) -------------
class Connection:
    """A reader's connection as `write_now` sees it: takes chunks until told it is full."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.full = False

    def write_now(self, chunk: bytes) -> bool:
        if self.full:
            return False
        self.written.append(chunk)
        return True


async def test_a_caught_up_reader_has_its_events_written_by_append_and_nothing_yielded() -> None:
    buffer = ReplayBuffer(max_events=100, numbered=True)
    buffer.append(b"opening")
    connection = Connection()
    yielded: list[bytes] = []

    async def read() -> None:
        async for chunk in buffer.follow(0, write_now=connection.write_now):
            yielded.append(chunk)

    reader = asyncio.create_task(read())
    await settle()
    assert yielded == [sse_event(1, b"opening")]  # a backlog still goes the reader's own way
    for index in range(5):
        buffer.append(b"%d" % index)  # written in append's own turn: no settle needed
    assert connection.written == [sse_event(sequence, b"%d" % (sequence - 2)) for sequence in range(2, 7)]
    buffer.close()
    await reader
    assert yielded == [sse_event(1, b"opening")]


async def test_a_write_that_cannot_be_made_at_once_wakes_the_reader_from_that_event_on() -> None:
    """A slow client's connection refuses a direct write: that event and every later one go the
    reader's own way (the ASGI send, which waits for the client), in order, none twice."""
    buffer = ReplayBuffer(max_events=100, numbered=True)
    connection = Connection()
    yielded: list[bytes] = []

    async def read() -> None:
        async for chunk in buffer.follow(0, write_now=connection.write_now):
            yielded.append(chunk)
            connection.full = False  # the reader's own write went out: the client caught up

    reader = asyncio.create_task(read())
    await settle()
    buffer.append(b"a")
    connection.full = True
    buffer.append(b"b")
    buffer.append(b"c")
    await settle()
    assert connection.written == [sse_event(1, b"a")]
    assert yielded == [sse_event(2, b"b") + sse_event(3, b"c")]
    buffer.append(b"d")  # caught up again: direct once more
    assert connection.written[-1] == sse_event(4, b"d")
    buffer.close()
    await reader
    every = b"".join(connection.written[:1] + yielded + connection.written[1:])
    assert event_ids(every) == [1, 2, 3, 4]


async def test_a_second_reader_follows_the_usual_way_and_a_cancelled_one_is_written_to_no_more() -> None:
    buffer = ReplayBuffer(max_events=100, numbered=True)
    first, second = Connection(), Connection()
    first_reader = asyncio.create_task(drain(buffer.follow(0, write_now=first.write_now)))
    await settle()
    second_reader = asyncio.create_task(drain(buffer.follow(0, write_now=second.write_now)))
    await settle()
    buffer.append(b"a")
    await settle()
    assert first.written == [sse_event(1, b"a")] and second.written == []  # one direct reader
    first_reader.cancel()  # its client left
    await asyncio.gather(first_reader, return_exceptions=True)
    buffer.append(b"b")
    assert first.written == [sse_event(1, b"a")]
    buffer.close()
    assert event_ids(await second_reader) == [1, 2]


async def test_a_paced_or_coalescing_reader_never_takes_direct_writes() -> None:
    for options in ({"events_per_write": lambda: 2}, {"coalesce_s": 0.001}):
        buffer = ReplayBuffer(max_events=100, numbered=True)
        connection = Connection()
        reader = asyncio.create_task(drain(buffer.follow(0, write_now=connection.write_now, **options)))
        await settle()
        for index in range(3):
            buffer.append(b"%d" % index)
            await settle()
        buffer.close()
        assert event_ids(await reader) == [1, 2, 3] and connection.written == []


def test_gc_pauses_are_observed_by_generation_while_the_block_runs() -> None:
    import gc

    from shared.obs.gc_pauses import gc_pauses_observed
    from shared.obs.metrics import Metrics

    metrics = Metrics()

    def collections(generation: str) -> float:
        value = metrics.registry.get_sample_value("bundle_gc_pause_seconds_count", {"generation": generation})
        return value or 0.0

    callbacks_before = list(gc.callbacks)
    gc.disable()  # only the collections asked for here: none set off by an allocation meanwhile
    try:
        with gc_pauses_observed(metrics.gc_pause):
            gc.collect(0)
            gc.collect(2)
            gc.collect(2)
        gc.collect(2)  # after the block: not observed
    finally:
        gc.enable()
    assert (collections("0"), collections("2")) == (1.0, 2.0)
    assert metrics.registry.get_sample_value("bundle_gc_pause_seconds_sum", {"generation": "2"}) > 0
    assert gc.callbacks == callbacks_before  # nothing left behind


def test_gc_thresholds_hold_for_the_block_and_are_restored_after() -> None:
    import gc

    from shared.gc_thresholds import gc_thresholds

    before = gc.get_threshold()
    with gc_thresholds((1234, 7, 99)):
        assert gc.get_threshold() == (1234, 7, 99)
    assert gc.get_threshold() == before


def test_gc_thresholds_setting_is_a_json_list_of_three_positive_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    from pydantic import ValidationError

    assert Settings().gc_thresholds == (700, 10, 10)  # Python's own
    monkeypatch.setenv("BUNDLE_GC_THRESHOLDS", "[2000, 20, 50]")
    assert Settings().gc_thresholds == (2000, 20, 50)
    for bad in ("[0, 10, 10]", "[700, 10]", "700"):
        monkeypatch.setenv("BUNDLE_GC_THRESHOLDS", bad)
        with pytest.raises(ValidationError):
            Settings()


def test_a_running_service_serves_with_its_gc_thresholds_and_times_collections() -> None:
    import gc

    from shared.assembly import start_service

    settings = Settings(gc_thresholds=(900, 9, 90))
    before = gc.get_threshold()

    async def inside() -> tuple[tuple[int, int, int], bytes]:
        async with start_service(settings, engine=ScriptedEngine(auto=True)) as service:
            gc.collect(1)
            return gc.get_threshold(), service.metrics.exposition()

    thresholds, exposition = asyncio.run(inside())
    assert thresholds == (900, 9, 90)
    assert b'bundle_gc_pause_seconds_count{generation="1"}' in exposition
    assert gc.get_threshold() == before


# --- a shutdown that hangs says where ----------------------------------------------------------------
async def test_a_slow_block_logs_each_pending_task_and_a_quick_one_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from shared.obs.slow_exit import report_if_slow

    stuck = asyncio.Event()

    async def waits_for_ever() -> None:
        await stuck.wait()

    task = asyncio.get_running_loop().create_task(waits_for_ever(), name="stuck-one")
    with caplog.at_level(logging.WARNING, logger="shared.obs.slow_exit"):
        with report_if_slow("a quick shutdown", 30):
            await asyncio.sleep(0)
        assert not caplog.records
        with report_if_slow("the test's shutdown", 0.05):
            await asyncio.sleep(0.3)  # the timer at 0.05 s comes first, however slow the machine
    stuck.set()
    await task
    (record,) = caplog.records
    assert "the test's shutdown still running" in record.getMessage()
    assert "stuck-one: " in record.getMessage() and "waits_for_ever" in record.getMessage()
