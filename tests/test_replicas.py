"""Request identity across two replicas: two `python -m shared.serve` processes, each with its own
real vLLM CPU engine, sharing one real Redis-protocol server (tests/redis_server.py).

One pair of replicas serves every scenario (two engines on a small machine are heavy), in this
order: duplicates spread over both, resume on the other replica, cancel from the other replica,
a store outage, the death of replica A, and last the death of replica B's engine (which ends
it)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from bench.servers import wait_healthy
from bundle_client.client import ResumableClient
from shared.replicas.store import PRODUCER_LOST_BOUND_S, Claim
from shared.replicas.store_keys import claim_key, replica_key
from tests.conftest import free_port, long_chat, wait_until
from tests.gate import Gate, Hold
from tests.real_server import ServerProcess, kill_engine_core_mid_stream
from tests.redis_server import RedisServer
from tests.test_api import sse_events
from tests.test_identity import CuttingTransport, read_events, sampled_chat, texts_of

# Generous: on a shared 2-core machine two engines starting side by side took minutes.
pytestmark = pytest.mark.timeout(600)

# A small engine per replica: both start at once, and two share this machine's cores. Takeover
# off: this module pins what the store does without it (a dead owner is `producer_lost`); with
# it, tests/test_takeover.py.
REPLICA_ENV = {
    "BUNDLE_MAX_NUM_SEQS": "32",
    "BUNDLE_MAX_MODEL_LEN": "1024",
    "BUNDLE_ENFORCE_EAGER": "true",
    "BUNDLE_LOG_LEVEL": "warning",
    "BUNDLE_TAKEOVER": "false",
}
LONG = 900  # tokens: a generation that is held mid-way (tests/gate.py) while a test acts on it
# Engine deltas let through before the hold: enough for the few events a test reads first (a
# delta that completes no character carries no text and makes no event).
HOLD_AFTER = 8


@dataclass
class Replica:
    url: str
    process: subprocess.Popen[bytes]
    log: Path
    gate: Gate  # holds this replica's generations (tests/gate.py)

    def kill(self) -> None:
        """Die like a crashed container: no shutdown, no last words to the store."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(30)


def _start(redis_url: str, log: Path) -> Replica:
    """The real server, its engine behind a gate whose control folder sits beside its log."""
    port = free_port()
    env = {**os.environ, **REPLICA_ENV, "BUNDLE_REDIS_URL": redis_url, "BUNDLE_PORT": str(port)}
    gate_dir = log.with_suffix(".gate")
    gate_dir.mkdir()
    with log.open("wb") as out:
        # Its own process group, so killing it takes its engine process along; the same session
        # as the test, so the kernel schedules it with the test (no autogroup of its own).
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.gated_serve", "--gate-dir", str(gate_dir)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            process_group=0,
        )
    return Replica(f"http://127.0.0.1:{port}", process, log, Gate(gate_dir))


@pytest.fixture(scope="module")
def replicas(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Replica]]:
    logs = tmp_path_factory.mktemp("replicas")
    pair = [_start(redis_server.url, logs / f"replica-{name}.log") for name in "ab"]
    try:
        deadline = time.monotonic() + 540
        for replica in pair:
            try:
                wait_healthy(replica.url, replica.process, deadline - time.monotonic(), interval_s=0.3)
            except RuntimeError as exc:
                raise RuntimeError(f"replica {replica.url}: {exc}; see {replica.log}") from None
        yield pair
    finally:
        for replica in pair:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(replica.process.pid, signal.SIGTERM)
        for replica in pair:
            with contextlib.suppress(subprocess.TimeoutExpired):
                replica.process.wait(30)
            replica.kill()


class Reader:
    """Reads one streaming response in steps: the first events, then (after acting) the rest."""

    def __init__(self, response: httpx.Response) -> None:
        self._pieces = response.aiter_raw()
        self.raw = b""

    async def events(self, count: int) -> None:
        while self.raw.count(b"\n\n") < count:
            self.raw += await anext(self._pieces)

    async def rest(self) -> bytes:
        async for piece in self._pieces:
            self.raw += piece
        return self.raw


def metric(url: str, name: str, labels: str = "") -> float:
    """Sum of a metric's samples on one replica's /metrics whose labels contain `labels`."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    samples = re.findall(rf"^{name}(\{{[^}}]*\}})? (\S+)$", text, re.M)
    return sum(float(value) for found, value in samples if labels in found)


def generations(pair: list[Replica]) -> float:
    return sum(metric(replica.url, "bundle_engine_generations_total") for replica in pair)


async def test_twenty_duplicates_over_two_replicas_share_one_generation(replicas: list[Replica]) -> None:
    before = generations(replicas)
    headers = {"X-Request-Id": "spread-twenty"}
    async with httpx.AsyncClient(timeout=60) as client:
        responses = await asyncio.gather(
            *(
                client.post(f"{replicas[i % 2].url}/v1/chat/completions", json=sampled_chat(), headers=headers)
                for i in range(20)
            )
        )
        whole = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 16}
        bodies = await asyncio.gather(
            *(
                client.post(
                    f"{r.url}/v1/chat/completions", json=whole, headers={"X-Request-Id": "spread-whole"}
                )
                for r in replicas
            )
        )
    streams = {r.content for r in responses}
    assert all(r.status_code == 200 for r in responses)
    assert len(streams) == 1 and texts_of(streams.pop())
    assert bodies[0].status_code == 200 and bodies[0].json() == bodies[1].json()
    assert generations(replicas) - before == 2  # one stream, one whole answer, over both replicas
    async with httpx.AsyncClient(timeout=60) as client:
        other = await client.post(
            f"{replicas[1].url}/v1/chat/completions", json=sampled_chat(65), headers=headers
        )
    assert other.status_code == 422 and other.json()["error"]["code"] == "request_id_conflict"


class SpreadingTransport(CuttingTransport):
    """Sends each request to the next replica in turn, cutting streams at random points."""

    def __init__(self, urls: list[str], cuts: int, rng: random.Random) -> None:
        super().__init__(cuts)
        self.urls = [httpx.URL(url) for url in urls]
        self.sent = 0
        self.rng = rng

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        target = self.urls[self.sent % len(self.urls)]
        self.sent += 1
        request.url = request.url.copy_with(host=target.host, port=target.port)
        self.after_events = self.rng.randint(1, 6)
        return await super().handle_async_request(request)


async def test_a_stream_dropped_on_one_replica_resumes_on_the_other(replicas: list[Replica]) -> None:
    a, b = (replica.url for replica in replicas)
    before = generations(replicas)
    body = sampled_chat(300)
    params = {k: v for k, v in body.items() if k not in ("messages", "stream")}
    transport = SpreadingTransport([a, b], cuts=5, rng=random.Random(14))
    http = httpx.AsyncClient(transport=transport, base_url=a, timeout=60)
    async with ResumableClient(a, http=http, backoff_s=0.01) as client:
        pieces = [p async for p in client.stream_chat(body["messages"], request_id="hop", **params)]
        assert client.reconnects == 5
    async with httpx.AsyncClient(timeout=60) as plain:
        uninterrupted = await plain.post(f"{a}/v1/chat/completions", json=body, headers={"X-Request-Id": "hop"})
        # Byte level: k events from A, the rest from B after Last-Event-ID k, equal the whole.
        headers = {"X-Request-Id": "hop-bytes", "Accept": "text/event-stream"}
        async with plain.stream("POST", f"{a}/v1/chat/completions", json=body, headers=headers) as cut:
            head = b"".join(await read_events(cut, 9))
        tail = await plain.post(
            f"{b}/v1/chat/completions", json=body, headers={**headers, "Last-Event-ID": "9"}
        )
        whole = await plain.post(f"{a}/v1/chat/completions", json=body, headers=headers)
    assert transport.cuts_left == 0 and transport.sent == 6
    assert "".join(pieces) == texts_of(uninterrupted.content)
    assert [event_id for event_id, _ in sse_events(head)] == list(range(1, 10))
    assert head + tail.content == whole.content
    assert generations(replicas) - before == 2


def held_chat(held: Hold) -> dict[str, Any]:
    return long_chat(max_tokens=LONG, messages=[{"role": "user", "content": held.prompt("tell me a story")}])


async def test_cancel_sent_to_b_aborts_the_generation_on_a(replicas: list[Replica]) -> None:
    a, b = (replica.url for replica in replicas)
    cancelled_before = metric(a, "bundle_aborted_requests_total", 'reason="cancelled"')
    headers = {"X-Request-Id": "cancel-on-b"}
    async with (
        httpx.AsyncClient(timeout=60) as client,
        contextlib.AsyncExitStack() as stack,
    ):
        held = stack.enter_context(replicas[0].gate.hold(after=HOLD_AFTER))
        stream = await stack.enter_async_context(
            client.stream("POST", f"{a}/v1/chat/completions", json=held_chat(held), headers=headers)
        )
        reader = Reader(stream)
        await held.until_held()  # A's generation is running, and stays so until the cancel
        await reader.events(3)
        outcome = await client.post(f"{b}/v1/requests/cancel-on-b/cancel")
        rest = await reader.rest()
    assert outcome.status_code == 200 and outcome.json()["status"] == "cancelled"
    assert b'"code":"request_cancelled"' in rest and rest.endswith(b"data: [DONE]\n\n")
    assert metric(a, "bundle_aborted_requests_total", 'reason="cancelled"') - cancelled_before == 1
    assert metric(a, "bundle_running_generations") == 0


async def _identified(client: httpx.AsyncClient, url: str, request_id: str) -> httpx.Response:
    return await client.post(
        f"{url}/v1/chat/completions", json=short_chat(), headers={"X-Request-Id": request_id}
    )


def short_chat() -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}


async def test_a_store_outage_refuses_ids_keeps_anonymous_and_recovers(
    replicas: list[Replica], redis_server: RedisServer
) -> None:
    anonymous = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
        "stream": True,
    }
    redis_server.stop()
    try:
        async with httpx.AsyncClient(timeout=60) as client:
            for n, replica in enumerate(replicas):
                refused = await _identified(client, replica.url, f"outage-{n}")
                assert refused.status_code == 503
                assert refused.json()["error"]["code"] == "identity_store_unavailable"
                served = await client.post(f"{replica.url}/v1/chat/completions", json=anonymous)
                assert served.status_code == 200 and served.content.endswith(b"data: [DONE]\n\n")
                assert metric(replica.url, "bundle_store_errors_total") >= 1
    finally:
        redis_server.start()
    async with httpx.AsyncClient(timeout=60) as client:
        for n, replica in enumerate(replicas):
            deadline = time.monotonic() + 10  # the next command reconnects; heartbeats resume
            while (response := await _identified(client, replica.url, f"back-{n}")).status_code != 200:
                assert time.monotonic() < deadline, response.text
                await asyncio.sleep(0.2)
            assert response.content.endswith(b"data: [DONE]\n\n")


async def test_followers_on_b_hear_that_replica_a_died(
    replicas: list[Replica], redis_server: RedisServer
) -> None:
    a, b = replicas
    # Both heartbeats are back in the store (restarted above) before the test relies on them.
    # A's and B's own keys by name: other servers of the session (tests/test_one_door.py's live
    # server stays up until the session ends) beat into the same store.
    async with httpx.AsyncClient(timeout=60) as client:
        ids = [await _replica_id(client, replica, redis_server) for replica in replicas]
    _wait_for_heartbeats(ids, redis_server)
    headers = {"X-Request-Id": "owner-dies"}
    async with (
        httpx.AsyncClient(timeout=60) as client,
        contextlib.AsyncExitStack() as stack,
    ):
        held = stack.enter_context(a.gate.hold(after=HOLD_AFTER))  # A never finishes: it dies
        body = held_chat(held)
        owner_stream = await stack.enter_async_context(
            client.stream("POST", f"{a.url}/v1/chat/completions", json=body, headers=headers)
        )
        await held.until_held()
        await Reader(owner_stream).events(2)
        url = f"{b.url}/v1/chat/completions"
        followers = [client.stream("POST", url, json=body, headers=headers) for _ in range(2)]
        async with followers[0] as first, followers[1] as second:
            if first.status_code != 200 or second.status_code != 200:
                bodies = [(await response.aread()).decode(errors="replace") for response in (first, second)]
                raise AssertionError(f"{bodies}; {_why_a_looked_dead(a, redis_server)}")
            readers = [Reader(first), Reader(second)]
            await asyncio.gather(*(reader.events(2) for reader in readers))
            a.kill()
            killed = time.monotonic()
            endings = await asyncio.gather(*(reader.rest() for reader in readers))
            waited = time.monotonic() - killed
    for ending in endings:
        assert b'"code":"producer_lost"' in ending and ending.endswith(b"data: [DONE]\n\n")
    assert waited < PRODUCER_LOST_BOUND_S + 2  # the documented bound, plus this machine's slack
    async with httpx.AsyncClient(timeout=60) as client:
        again = await client.post(f"{b.url}/v1/chat/completions", json=body, headers=headers)
    assert again.status_code == 410 and again.json()["error"]["code"] == "producer_lost"


async def _replica_id(client: httpx.AsyncClient, replica: Replica, redis_server: RedisServer) -> str:
    """The id `replica` claims requests under (random per process): the owner of a claim it made."""
    request_id = f"whoami-{uuid.uuid4().hex[:8]}"
    assert (await _identified(client, replica.url, request_id)).status_code == 200
    store = redis.Redis.from_url(redis_server.url)
    try:
        return Claim.decode(store.get(claim_key(request_id))).owner
    finally:
        store.close()


def _wait_for_heartbeats(replica_ids: list[str], redis_server: RedisServer) -> None:
    store = redis.Redis.from_url(redis_server.url)
    try:
        wait_until(lambda: all(store.exists(replica_key(rid)) for rid in replica_ids), timeout=30)
    except AssertionError:
        beats = {key.decode(): store.pttl(key) for key in store.keys(replica_key("*"))}
        missing = f"heartbeats of {replica_ids} not all back; in the store (ms left): {beats}"
        raise AssertionError(missing) from None
    finally:
        store.close()


def _why_a_looked_dead(a: Replica, redis_server: RedisServer) -> str:
    """What to read when B found A's heartbeat gone (seen once in CI): how late A's event loop
    ran, and the end of A's log (a heartbeat error is logged there)."""
    store = redis.Redis.from_url(redis_server.url)
    beats = {key.decode(): store.pttl(key) for key in store.keys(replica_key("*"))}
    store.close()
    lag = httpx.get(f"{a.url}/metrics", timeout=10).text
    lag_lines = [line for line in lag.splitlines() if line.startswith("bundle_event_loop_lag_seconds_")]
    tail = a.log.read_text(errors="replace")[-1500:]
    return f"heartbeats (ms left): {beats}; A's loop lag: {lag_lines}; A's log ends:\n{tail}"


def test_killing_bs_engine_core_ends_its_streams_refuses_new_work_and_exits_non_zero(
    replicas: list[Replica],
) -> None:
    """Engine death on the real engine (issue 18), on replica B once A is gone: the suite has
    already paid for B's engine, so this needs no start of its own. The stream is anonymous,
    so the store is not involved; B exits with ENGINE_DEAD_EXIT_CODE (checked inside)."""
    b = replicas[1]
    took = kill_engine_core_mid_stream(ServerProcess(b.process, b.url, b.log, b.gate), max_tokens=LONG)
    print(f"replica B exited {took:.1f} s after its engine core was killed")
