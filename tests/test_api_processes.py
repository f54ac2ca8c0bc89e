"""Two API processes on one engine core (BUNDLE_API_PROCESSES=2): a real `python -m shared.serve`
on the real CPU engine, with no BUNDLE_REDIS_URL, so its own local valkey-server carries request
identity between the processes (shared/procs/).

Each process is reached on purpose through a connection pinned to it (tests/procs_helpers.py,
the `X-Bundle-Api-Process` header); where a generation must still be running while a test acts
on it, the engine core is held (SIGSTOP) rather than raced. One server serves the scenarios in
order and ends with its engine's death; a second one is ended by SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
import pytest

from bench.identity_burst import burst
from shared.obs.process_metrics import PUBLISH_INTERVAL_S
from shared.server_state import ENGINE_DEAD_EXIT_CODE
from tests.conftest import long_chat, wait_until
from tests.procs_helpers import EngineHold, PinnedClients, StreamReader, left_running, process_tree, served_by
from tests.real_server import ENGINE_DEATH_EXIT_BOUND_S, ServerProcess, bundle_server
from tests.test_api import sse_events
from tests.test_identity import texts_of

pytestmark = pytest.mark.timeout(900)  # each server's start (two engine clients, a core) is slow here

PROCESSES = 2
SERVER = {
    "api_processes": str(PROCESSES),
    "max_num_seqs": "16",  # every process warms up with a wave this wide
    "keep_alive_s": "600",  # a pinned connection must not be closed under a test
    "log_level": "info",
}
LONG = 1500  # tokens: far more than a test reads before it holds the engine
# A figure published by another process shows up within one publishing interval; generous here.
METRICS_SETTLE_S = 20 * PUBLISH_INTERVAL_S
STEADY_S = 2.5 * PUBLISH_INTERVAL_S  # unchanged this long on every process: all published
CHAT = "/v1/chat/completions"
GENERATIONS = "bundle_engine_generations_total"


@dataclass
class Running:
    server: ServerProcess
    pins: PinnedClients

    def hold(self) -> EngineHold:
        return EngineHold(self.server.engine_core())


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    with bundle_server(tmp_path_factory.mktemp("procs"), **SERVER) as server:
        pins = PinnedClients(server.url, PROCESSES)
        try:
            yield Running(server, pins)
        finally:
            pins.close()


def metric(client: httpx.Client, name: str, labels: str = "") -> float:
    """A metric's samples on /metrics whose labels contain `labels`, summed."""
    text = client.get("/metrics").text
    samples = re.findall(rf"^{name}(\{{[^}}]*\}})? (\S+)$", text, re.M)
    return sum(float(value) for found, value in samples if labels in found)


def settled(pins: PinnedClients, name: str, labels: str = "") -> float:
    """The whole-server figure once it holds still: every process reports the same value, and
    keeps reporting it for longer than two publishing intervals (each process adds the others'
    last snapshots to its own live figures, so a recent change may show on one process first)."""
    steady: list[tuple[float, float]] = []  # (when, value) of agreeing readings, oldest first
    deadline = time.monotonic() + METRICS_SETTLE_S
    while time.monotonic() < deadline:
        readings = {metric(pins.client(index, "probe"), name, labels) for index in range(PROCESSES)}
        now = time.monotonic()
        value = readings.pop() if len(readings) == 1 else None
        if value is None or (steady and steady[0][1] != value):
            steady.clear()
        if value is not None:
            steady.append((now, value))
            if now - steady[0][0] > STEADY_S:
                return value
        time.sleep(0.2)
    raise AssertionError(f"{name}{{{labels}}} did not settle in {METRICS_SETTLE_S} s")


def running_here(pins: PinnedClients, index: int) -> float:
    """Generations process `index` drives right now: its own live figure is in its /metrics."""
    return metric(pins.client(index, "probe"), "bundle_running_generations")


def test_both_processes_serve_the_port_and_metrics_count_both(running: Running) -> None:
    pins = running.pins
    before = settled(pins, GENERATIONS)
    body = {"model": "tiny", "prompt": "count me", "max_tokens": 4}
    for index in range(PROCESSES):
        answer = pins.client(index).post("/v1/completions", json=body)
        assert answer.status_code == 200 and served_by(answer) == index, answer.text
    assert settled(pins, GENERATIONS) == before + PROCESSES
    for index in range(PROCESSES):
        assert metric(pins.client(index), "bundle_api_processes") == PROCESSES


def test_one_request_id_sent_to_both_processes_runs_one_generation(running: Running) -> None:
    pins = running.pins
    before = settled(pins, GENERATIONS)
    attached = settled(pins, "bundle_attached_requests_total")
    headers = {"X-Request-Id": "procs-one-id", "Accept": "text/event-stream"}
    body = long_chat(max_tokens=48)
    with running.hold() as hold:
        hold.stop()  # both requests arrive while the generation cannot have finished
        with (
            pins.client(0).stream("POST", CHAT, json=body, headers=headers) as first,
            pins.client(1).stream("POST", CHAT, json=body, headers=headers) as second,
        ):
            assert (first.status_code, served_by(first)) == (200, 0)
            assert (second.status_code, served_by(second)) == (200, 1)
            hold.release()
            owner, follower = StreamReader(first).rest(), StreamReader(second).rest()
    assert texts_of(owner) and owner == follower  # the same events, ids and all
    assert settled(pins, GENERATIONS) == before + 1
    assert settled(pins, "bundle_attached_requests_total") == attached + 1


def test_a_burst_of_ids_fails_none_and_runs_one_generation_per_id(running: Running) -> None:
    """Full load (issue 48): 256 streams with ids at once and 64 of them again, spread over both
    processes by the kernel as new connections come: no answer but 200 (the local store holds),
    every client of an id the same bytes, one engine generation per id."""
    pins = running.pins
    before = settled(pins, GENERATIONS)
    result = asyncio.run(burst([running.server.url], streams=256, duplicates=64))
    assert result.non_2xx == 0, result.failures
    assert not result.differing_ids
    assert settled(pins, GENERATIONS) - before == 256


def test_a_stream_cut_on_one_process_resumes_on_the_other(running: Running) -> None:
    pins = running.pins
    headers = {"X-Request-Id": "procs-resume", "Accept": "text/event-stream"}
    body = long_chat(max_tokens=LONG)
    with running.hold() as hold:
        with pins.client(0).stream("POST", CHAT, json=body, headers=headers) as cut:
            head = StreamReader(cut).events(6)
            hold.stop()
            assert running_here(pins, 0) == 1, "the generation ended before the engine was held"
        # The client went away; with an X-Request-Id the generation waits for it to come back.
        last = sse_events(head)[-1][0]
        assert [event_id for event_id, _ in sse_events(head)] == list(range(1, (last or 0) + 1))
        resume = {**headers, "Last-Event-ID": str(last)}
        with pins.client(1).stream("POST", CHAT, json=body, headers=resume) as tail_response:
            assert (tail_response.status_code, served_by(tail_response)) == (200, 1)
            hold.release()
            tail = StreamReader(tail_response).rest()
    whole = pins.client(0).post(CHAT, json=body, headers=headers)  # replayed: it has finished
    assert served_by(whole) == 0 and tail.endswith(b"data: [DONE]\n\n")
    assert head + tail == whole.content
    assert texts_of(whole.content)


def test_cancel_sent_to_the_other_process_ends_the_generation(running: Running) -> None:
    pins = running.pins
    cancelled = settled(pins, "bundle_aborted_requests_total", 'reason="cancelled"')
    headers = {"X-Request-Id": "procs-cancel"}
    with running.hold() as hold:
        with pins.client(0).stream("POST", CHAT, json=long_chat(max_tokens=LONG), headers=headers) as stream:
            reader = StreamReader(stream)
            reader.events(4)
            hold.stop()
            assert running_here(pins, 0) == 1, "the generation ended before the engine was held"
            outcome = pins.client(1).post("/v1/requests/procs-cancel/cancel")
            rest = reader.rest()
    assert (outcome.status_code, served_by(outcome)) == (200, 1), outcome.text
    assert outcome.json()["status"] == "cancelled"
    assert b'"code":"request_cancelled"' in rest and rest.endswith(b"data: [DONE]\n\n")
    assert settled(pins, "bundle_aborted_requests_total", 'reason="cancelled"') == cancelled + 1
    wait_until(lambda: settled(pins, "bundle_engine_running_requests") == 0, METRICS_SETTLE_S)


def test_the_engine_cores_death_ends_both_processes_with_the_documented_code(running: Running) -> None:
    """Last on this server: it ends it."""
    pins, server = running.pins, running.server
    processes = process_tree(server.process.pid)
    with running.hold() as hold, streams_on_each(pins) as readers:
        hold.stop()
        hold.core.send_signal(signal.SIGKILL)  # both streams still running: the engine was held
        endings = [reader.rest() for reader in readers]
    for ending in endings:
        assert ending.endswith(b"data: [DONE]\n\n"), ending[-300:]
        error = orjson.loads(sse_events(ending)[-2][1])["error"]
        assert error["code"] == "engine_unavailable", error
    for index in range(PROCESSES):
        refused = pins.client(index).post(CHAT, json=long_chat(max_tokens=4))
        assert (refused.status_code, served_by(refused)) == (503, index), refused.text
        assert refused.json()["error"]["code"] == "engine_unavailable"
    code = server.wait(timeout=ENGINE_DEATH_EXIT_BOUND_S)
    assert code == ENGINE_DEAD_EXIT_CODE, server.log.read_text()[-3000:]
    assert left_running(processes, timeout=30) == []
    assert_workdir_removed(server.log)


def test_sigterm_to_the_server_drains_both_processes_and_leaves_nothing(tmp_path: Path) -> None:
    """SIGTERM to the server's own process only, as a container runtime sends it: it reaches
    both API processes through the supervisor, each drains its streams (held, so they end at the
    grace with the shutdown error), and then the engine core and the local store stop."""
    with bundle_server(tmp_path, **SERVER, shutdown_grace_s="2") as server:
        pins = PinnedClients(server.url, PROCESSES)
        processes = process_tree(server.process.pid)
        endings = _drained(server, pins)
        code = server.wait(timeout=60)
        pins.close()
    for ending in endings:
        error = orjson.loads(sse_events(ending)[-2][1])["error"]
        assert error["code"] == "server_shutting_down" and ending.endswith(b"data: [DONE]\n\n"), ending[-300:]
    # As one server process ends after SIGTERM (tests/test_shutdown.py): by the signal, or 0.
    assert code in (-signal.SIGTERM, 0), server.log.read_text()[-3000:]
    assert left_running(processes, timeout=30) == []
    assert_workdir_removed(server.log)


def _drained(server: ServerProcess, pins: PinnedClients) -> list[bytes]:
    """Streams on both processes, held; SIGTERM to the server; each stream read to its end."""
    with EngineHold(server.engine_core()) as hold, streams_on_each(pins) as readers:
        hold.stop()
        server.process.send_signal(signal.SIGTERM)
        return [reader.rest() for reader in readers]


@contextlib.contextmanager
def streams_on_each(pins: PinnedClients) -> Iterator[list[StreamReader]]:
    """A long stream on each API process, its first events read."""
    with contextlib.ExitStack() as stack:
        readers = []
        for index in range(PROCESSES):
            request = pins.client(index).stream("POST", CHAT, json=long_chat(max_tokens=LONG))
            response = stack.enter_context(request)
            assert (response.status_code, served_by(response)) == (200, index)
            readers.append(StreamReader(response))
            readers[-1].events(4)
        yield readers


def assert_workdir_removed(log: Path) -> None:
    """The supervisor's scratch directory (its local store's socket, the metrics board), named
    in its log, is gone."""
    named = set(re.findall(r"unix://(\S+)/valkey\.sock", log.read_text(errors="replace")))
    assert named, "the log names no local store"
    assert [path for path in named if Path(path).exists()] == []
