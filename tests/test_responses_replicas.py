"""Responses across two replicas sharing a real Redis-protocol server: a response created on A is
streamed again and cancelled from B, and when A dies B reports the response `failed` instead of
waiting for ever (takeover off here; with it, tests/test_takeover.py: the response completes).
A is a `python -m tests.gated_serve` process (the real server, its engine behind the test gate, so
it can be killed like a crashed container while its generation is held mid-way); B is an app on
the test session's engine."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator

import openai
import pytest
from openai.types.responses import ResponseStreamEvent

from bench.servers import wait_healthy
from shared.replicas.store import PRODUCER_LOST_BOUND_S
from tests.conftest import LiveServers
from tests.redis_server import RedisServer
from tests.test_replicas import Replica, _start

pytestmark = pytest.mark.timeout(600)
LONG = 900  # output tokens (the replica's context is 1024): held on A long before its end
# Engine deltas let through on A before its hold: enough for the few text deltas a test reads
# (a delta that completes no character carries no text, so some may be empty).
HOLD_AFTER = 24


@pytest.fixture(scope="module")
def pair(
    redis_server: RedisServer, live: LiveServers, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Replica, str]]:
    a = _start(redis_server.url, tmp_path_factory.mktemp("responses-replicas") / "replica-a.log")
    try:
        wait_healthy(a.url, a.process, 540, interval_s=0.3)
        b_url, _ = live.serve(redis_url=redis_server.url, takeover=False)  # with it: tests/test_takeover.py
        yield a, b_url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(a.process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            a.process.wait(30)
        a.kill()


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def text_deltas(stream: Iterator[ResponseStreamEvent], count: int) -> list[ResponseStreamEvent]:
    """The stream's events up to and including its `count`-th text delta."""
    seen: list[ResponseStreamEvent] = []
    while sum(e.type == "response.output_text.delta" for e in seen) < count:
        seen.append(next(stream))
    return seen


def test_created_on_a_streamed_and_cancelled_from_b(pair: tuple[Replica, str]) -> None:
    a, b_url = pair
    with sdk(a.url) as on_a, sdk(b_url) as on_b, a.gate.hold(after=HOLD_AFTER) as held:
        created = on_a.responses.create(
            model="tiny", input=held.prompt("go on"), max_output_tokens=LONG, background=True
        )
        held.wait_held()
        stream = on_b.responses.retrieve(created.id, stream=True, starting_after=2)
        seen = [next(stream) for _ in range(5)]
        assert [e.sequence_number for e in seen] == [3, 4, 5, 6, 7]
        cancelled = on_b.responses.cancel(created.id)
        assert cancelled.status == "cancelled"
        rest = list(stream)
        numbers = [e.sequence_number for e in seen + rest]
        assert numbers == list(range(3, 3 + len(numbers)))  # no gap, no duplicate
        assert rest[-1].type == "response.failed" and rest[-1].response.status == "cancelled"
        assert on_a.responses.retrieve(created.id).status == "cancelled"


def test_b_reports_failed_when_a_dies_mid_generation(pair: tuple[Replica, str]) -> None:
    a, b_url = pair
    with sdk(a.url) as on_a, sdk(b_url) as on_b, a.gate.hold(after=HOLD_AFTER) as held:
        created = on_a.responses.create(
            model="tiny", input=held.prompt("go on"), max_output_tokens=LONG, background=True
        )
        held.wait_held()
        stream = on_b.responses.retrieve(created.id, stream=True)
        seen = text_deltas(stream, 1)  # B follows the generation A holds mid-way
        assert on_b.responses.retrieve(created.id).status == "in_progress"
        a.kill()
        killed = time.monotonic()
        rest = list(stream)
        waited = time.monotonic() - killed
        assert rest[-1].type == "response.failed" and rest[-1].response.error.code == "producer_lost"  # type: ignore[union-attr]
        assert waited < PRODUCER_LOST_BOUND_S + 5  # the documented bound, plus this machine's slack
        numbers = [e.sequence_number for e in seen + rest]
        assert numbers == list(range(len(numbers)))
        polled = on_b.responses.retrieve(created.id)
        assert polled.status == "failed" and polled.error is not None and polled.error.code == "producer_lost"
        assert "stopped" in polled.error.message
