"""Takeover with real parts: replicas A and B are `python -m tests.takeover_replica` processes (the
bundle's server on the real vLLM CPU engine, its outputs behind a gate the test holds and opens),
C is an app on the test session's engine, and all three share a real Redis-protocol server.
Clients are httpx, the official `openai` SDK and `bundle_client`.

"After k tokens" never races the engine: A's gate holds every generation after k engine outputs,
the test waits until the gate reports them held, and only then signals or kills A.

In order (one engine start is minutes on this machine, so each process is used for several
scenarios): SIGTERM of A with 20 streams attached (all handed over to B); A again, paused past
its lease (fenced out when it comes back); A again, SIGKILLed with six generations held (a chat
stream resumed on B, a background Response finished by itself, two replicas racing, structured
output and n > 1, a Cog prediction on C); last, B killed during its own takeover, C goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cog_bridge as bridge
import cog_inputs
import httpx
import openai
import orjson
import pytest

from bench.identity_burst import burst
from bench.servers import wait_healthy
from bundle_client.client import ResumableClient
from shared.engine.contract import SamplingRequest
from shared.obs.metrics import Metrics
from shared.replicas.store import PRODUCER_LOST_BOUND_S, IdentityStore
from shared.replicas.store_keys import replica_key
from shared.replicas.takeover import Recipe, plan, read_log
from shared.service import Service
from tests.conftest import LiveServers, free_port, wait_until
from tests.redis_server import RedisServer
from tests.takeover_replica import GATE_VARIABLE, FileGate
from tests.test_api import sse_events

pytestmark = pytest.mark.timeout(600)

REPLICA_ENV = {
    "BUNDLE_MAX_NUM_SEQS": "32",
    "BUNDLE_MAX_MODEL_LEN": "1024",
    "BUNDLE_ENFORCE_EAGER": "true",
    "BUNDLE_WARM_UP": "false",
    "BUNDLE_LOG_LEVEL": "warning",
    "BUNDLE_SHUTDOWN_GRACE_S": "1",  # the drain's deadline comes at once; then the hand-off
}
PROMPT = "tell me a long story"
TOKENS = 160
HANDOFF_AFTER = 4  # tokens each stream gets at most before A is signalled or paused
KILL_AFTER = 21  # and before A is killed
START_S = 540  # two engines starting side by side on a shared 2-core machine took minutes


def story(**extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }


# --- replicas -------------------------------------------------------------------------------------
@dataclass
class Replica:
    name: str
    url: str
    process: subprocess.Popen[bytes]
    log: Path
    gate: FileGate

    def kill(self) -> None:
        """Die like a crashed container: no shutdown, no last words to the store."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(30)

    def metric(self, name: str, labels: str = "") -> float:
        return metric(self.url, name, labels)


def start_replica(name: str, redis_url: str, workdir: Path) -> Replica:
    port = free_port()
    gate = FileGate(workdir / f"gate-{name}")
    env = {**os.environ, **REPLICA_ENV, "BUNDLE_REDIS_URL": redis_url, "BUNDLE_PORT": str(port)}
    env[GATE_VARIABLE] = str(gate.path)
    log = workdir / f"replica-{name}.log"
    with log.open("ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.takeover_replica"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            process_group=0,  # killing the group takes its engine along
        )
    return Replica(name, f"http://127.0.0.1:{port}", process, log, gate)


def healthy(*replicas: Replica) -> None:
    deadline = time.monotonic() + START_S
    for replica in replicas:
        try:
            wait_healthy(replica.url, replica.process, deadline - time.monotonic(), interval_s=0.3)
        except RuntimeError as exc:
            raise RuntimeError(f"replica {replica.name}: {exc}; see {replica.log}") from None


def metric(url: str, name: str, labels: str = "") -> float:
    """Sum of a metric's samples on one replica's /metrics whose labels contain `labels`."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    samples = re.findall(rf"^{name}(\{{[^}}]*\}})? (\S+)$", text, re.M)
    return sum(float(value) for found, value in samples if labels in found)


@dataclass
class Cluster:
    redis: RedisServer
    workdir: Path
    a: Replica
    b: Replica
    c_url: str
    c: Service
    live: LiveServers
    references: dict[str, bytes] = field(default_factory=dict)

    def store(self) -> IdentityStore:
        """The shared store as the test reads it (on the test's own event loop; no heartbeat)."""
        return IdentityStore(self.redis.url, "test-reader", Metrics())

    def a_alive(self) -> Replica:
        """A, started again if an earlier test ended it."""
        return self.a if self.a.process.poll() is None else self.restart_a()

    def restart_a(self) -> Replica:
        self.a.kill()
        self.a = start_replica(f"a{len(list(self.workdir.glob('replica-a*')))}", self.redis.url, self.workdir)
        healthy(self.a)
        return self.a

    async def reference(self, body: dict[str, Any]) -> bytes:
        """The uninterrupted stream of `body` (on B, whose gate is open), once per body."""
        key = orjson.dumps(body, option=orjson.OPT_SORT_KEYS).decode()
        if key not in self.references:
            async with httpx.AsyncClient(timeout=120) as client:
                answer = await client.post(
                    f"{self.b.url}/v1/chat/completions", json=body, headers=identified(f"reference-{len(key)}")
                )
            assert answer.status_code == 200, answer.text
            self.references[key] = answer.content
        return self.references[key]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, live: LiveServers) -> Iterator[Cluster]:
    workdir = tmp_path_factory.mktemp("takeover")
    redis = RedisServer(workdir)
    redis.start()
    a, b = (start_replica(name, redis.url, workdir) for name in "ab")
    try:
        healthy(a, b)
        c_url, c = live.serve(redis_url=redis.url)
        cluster = Cluster(redis, workdir, a, b, c_url, c, live)
        yield cluster
    finally:
        for replica in (a, b):
            replica.kill()
        with contextlib.suppress(NameError):
            cluster.a.kill()
        redis.stop()


# --- reading streams ------------------------------------------------------------------------------
def identified(request_id: str, last_event_id: int | None = None) -> dict[str, str]:
    headers = {"X-Request-Id": request_id, "Accept": "text/event-stream"}
    if last_event_id is not None:
        headers["Last-Event-ID"] = str(last_event_id)
    return headers


class Reader:
    """Reads one streaming response in steps: some events, then (after acting) the rest."""

    def __init__(self, response: httpx.Response) -> None:
        self._pieces = response.aiter_raw()
        self.raw = b""

    async def events(self, count: int) -> bytes:
        """The first `count` events (the raw bytes read so far may hold more)."""
        while self.raw.count(b"\n\n") < count:
            self.raw += await anext(self._pieces)
        return b"".join(block + b"\n\n" for block in self.raw.split(b"\n\n")[:count])

    async def rest(self) -> bytes:
        with contextlib.suppress(httpx.HTTPError):  # a connection cut by a kill ends the reading
            async for piece in self._pieces:
                self.raw += piece
        return self.raw


@contextlib.asynccontextmanager
async def streaming(
    url: str, body: dict[str, Any], request_id: str, last_event_id: int | None = None
) -> AsyncIterator[Reader]:
    async with (
        httpx.AsyncClient(timeout=120) as client,
        client.stream(
            "POST", f"{url}/v1/chat/completions", json=body, headers=identified(request_id, last_event_id)
        ) as response,
    ):
        assert response.status_code == 200, await response.aread()
        yield Reader(response)


def text_of(raw: bytes) -> str:
    pieces = []
    for _, data in sse_events(raw):
        if data != b"[DONE]":
            for choice in orjson.loads(data).get("choices") or ():
                pieces.append((choice.get("delta") or {}).get("content") or "")
    return "".join(pieces)


def usage_of(raw: bytes) -> dict[str, int]:
    found = [orjson.loads(data)["usage"] for _, data in sse_events(raw) if b'"usage":{' in data]
    assert len(found) == 1, raw[-500:]
    return dict(found[0])


def ids_of(raw: bytes) -> list[int | None]:
    return [event_id for event_id, _ in sse_events(raw)]


def whole_and_numbered(raw: bytes) -> None:
    """Every event numbered 1, 2, 3... without a gap or a repeat, ending with [DONE], no error."""
    assert ids_of(raw) == list(range(1, len(sse_events(raw)) + 1))
    assert raw.endswith(b"data: [DONE]\n\n") and b'"error"' not in raw


class AtoB(httpx.AsyncHTTPTransport):
    """A load balancer that sends a client's first request to A and every later one to B."""

    def __init__(self, a: str, b: str) -> None:
        super().__init__()
        self.targets = [httpx.URL(a), httpx.URL(b)]
        self.sent = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        target = self.targets[min(self.sent, 1)]
        self.sent += 1
        request.url = request.url.copy_with(host=target.host, port=target.port)
        return await super().handle_async_request(request)


def logged_events(cluster: Cluster, request_id: str) -> int:
    """How many events the log of a generation holds, once its replica is held by its gate: its
    last writes (sent right before the hold) are in the store when two reads a second apart agree."""
    import redis

    client = redis.Redis.from_url(cluster.redis.url)
    try:
        counts = [-1, -2]
        while counts[-1] != counts[-2]:
            time.sleep(1.0)
            counts.append(client.xlen(f"bundle:events:{request_id}"))
        return counts[-1]
    finally:
        client.close()


def wait_held(gate: FileGate, count: int) -> None:
    try:
        wait_until(lambda: gate.held() >= count, timeout=120, interval=0.05)
    except AssertionError:
        held = gate.held_log.read_text() if gate.held_log.exists() else ""
        raise AssertionError(f"{gate.held()} generations held, not {count}:\n{held}") from None


# --- full load: no 503 from the store, no live replica taken over ----------------------------------
async def test_a_burst_of_ids_over_both_replicas_fails_none_and_generates_once_per_id(cluster: Cluster) -> None:
    """256 streams with ids at once, and 64 of them again on the other replica (issue 48): no
    answer but 200, every client of an id the same bytes, one engine generation per id."""
    result = await burst([cluster.a.url, cluster.b.url], streams=256, duplicates=64)
    assert result.non_2xx == 0, result.failures
    assert not result.differing_ids
    assert result.generations == 256


async def test_a_replica_frozen_for_six_seconds_is_not_taken_over(cluster: Cluster) -> None:
    """A's whole process group stopped (SIGSTOP: its sockets stay open, its loop and beats stop)
    for 6 s, under its 10 s lease, while a client follows its stream on B: B does not take it
    over, both clients get the same whole stream, and A's one generation is the only one."""
    a, b = cluster.a_alive(), cluster.b
    counts = {
        "takeovers": b.metric("bundle_takeovers_total"),
        "lost": a.metric("bundle_claims_lost_total"),
        "generations": a.metric("bundle_engine_generations_total")
        + b.metric("bundle_engine_generations_total"),
    }
    a.gate.set(HANDOFF_AFTER)
    held = a.gate.held()
    async with streaming(a.url, story(), "frozen") as on_a:
        await asyncio.to_thread(wait_held, a.gate, held + 1)
        async with streaming(b.url, story(), "frozen") as on_b:
            await asyncio.gather(on_a.events(1), on_b.events(1))
            os.killpg(a.process.pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(6)
            finally:
                os.killpg(a.process.pid, signal.SIGCONT)
            a.gate.set(None)
            whole_a, whole_b = await asyncio.gather(on_a.rest(), on_b.rest())
    whole_and_numbered(whole_a)
    assert whole_a == whole_b
    assert b.metric("bundle_takeovers_total") == counts["takeovers"]
    assert a.metric("bundle_claims_lost_total") == counts["lost"]
    generations = a.metric("bundle_engine_generations_total") + b.metric("bundle_engine_generations_total")
    assert generations - counts["generations"] == 1


# --- SIGTERM: the drain hands streams over ---------------------------------------------------------
async def test_sigterm_hands_twenty_attached_streams_over_and_none_ends_in_error(cluster: Cluster) -> None:
    a, b = cluster.a, cluster.b
    reference = await cluster.reference(story())
    handed_before = b.metric("bundle_takeovers_total", 'outcome="continued"')
    a.gate.set(HANDOFF_AFTER)
    params = {key: value for key, value in story().items() if key not in ("messages", "stream")}
    clients = [
        ResumableClient(
            a.url,
            http=httpx.AsyncClient(transport=AtoB(a.url, b.url), base_url=a.url, timeout=120),
            backoff_s=0.05,
        )
        for _ in range(20)
    ]

    async def read(client: ResumableClient, n: int) -> str:
        pieces = [p async for p in client.stream_chat(story()["messages"], request_id=f"drain-{n}", **params)]
        return "".join(pieces)

    readers = [asyncio.ensure_future(read(client, n)) for n, client in enumerate(clients)]
    await asyncio.to_thread(wait_held, a.gate, 20)  # all 20 attached to A, each held mid-way
    a.process.send_signal(signal.SIGTERM)  # the API process only, as a container runtime does
    texts = await asyncio.gather(*readers)  # none raises: no stream ended in an error
    assert texts == [text_of(reference)] * 20
    assert all(client.reconnects == 1 for client in clients)  # cut once on A, resumed once on B
    assert b.metric("bundle_takeovers_total", 'outcome="continued"') - handed_before == 20
    assert a.process.wait(60) is not None
    for client in clients:
        await client.aclose()


# --- a pause past the lease ------------------------------------------------------------------------
async def test_a_replica_back_from_a_pause_is_fenced_out_and_its_client_goes_on(cluster: Cluster) -> None:
    a, b = cluster.a_alive(), cluster.b
    reference = await cluster.reference(story())
    a.gate.set(HANDOFF_AFTER)
    held = a.gate.held()
    async with streaming(a.url, story(), "paused") as on_a:
        await asyncio.to_thread(wait_held, a.gate, held + 1)
        sent = await asyncio.to_thread(logged_events, cluster, "paused")
        head = await on_a.events(sent)
        os.kill(a.process.pid, signal.SIGSTOP)  # the API process freezes; its 10 s lease lapses
        try:
            store = cluster.store()
            claim = await store.get("paused")
            assert claim is not None
            owner = claim.owner
            async with asyncio.timeout(PRODUCER_LOST_BOUND_S + 10):
                while await store.client.exists(replica_key(owner)):
                    await asyncio.sleep(0.1)
            async with streaming(b.url, story(), "paused", last_event_id=sent) as on_b:
                tail = await on_b.rest()
        finally:
            os.kill(a.process.pid, signal.SIGCONT)
        a.gate.set(None)  # A's generation would go on now: its next write is fenced out
        await asyncio.to_thread(wait_until, lambda: a.metric("bundle_claims_lost_total") == 1, 30)
        after_pause = await asyncio.wait_for(on_a.rest(), 30)
    whole = head + tail
    whole_and_numbered(whole)
    assert text_of(whole) == text_of(reference) and usage_of(whole) == usage_of(reference)
    # A's client got nothing of A's own after the pause: it went on from the log, B's tokens
    assert after_pause == whole
    entries, recipe = await store.log("paused")
    assert [sequence for sequence, _ in entries] == ids_of(whole)  # one log, no event of A's after
    assert a.metric("bundle_engine_running_requests") == 0


# --- SIGKILL of A with six generations held --------------------------------------------------------
@dataclass
class Killed:
    chat_head: bytes  # what the client of the chat stream read from A: every event it sent
    response_id: str  # a background Response created on A
    killed_at: float


N2 = story(n=2, temperature=1.0, seed=1)  # vLLM draws n > 1 only by sampling


def cog_body(cluster: Cluster) -> Any:
    return cog_inputs.request_from_inputs(
        cluster.c.settings, prompt=PROMPT, max_tokens=TOKENS, temperature=0.0, top_k=0, top_p=1.0
    )


@pytest.fixture(scope="module")
def killed(cluster: Cluster) -> Iterator[Killed]:
    a = cluster.a_alive()
    a.gate.set(KILL_AFTER)
    held = a.gate.held()
    structured = story(response_format=_story_schema())
    with httpx.Client(timeout=120) as client:
        for request_id, body in (("race", story()), ("structured", structured), ("n2", N2)):
            _start_in_background(a.url, body, request_id)
        _start_in_background(a.url, story(), "taken-twice")
        cog = cog_body(cluster).model_dump(mode="json", exclude_unset=True, by_alias=True)
        _start_in_background(a.url, cog, "cog-prediction")
        created = client.post(
            f"{a.url}/v1/responses",
            json={
                "model": "tiny",
                "input": PROMPT,
                "max_output_tokens": TOKENS,
                "temperature": 0,
                "background": True,
            },
        )
        assert created.status_code == 200, created.text
        with client.stream(
            "POST", f"{a.url}/v1/chat/completions", json=story(), headers=identified("killed")
        ) as stream:
            assert stream.status_code == 200
            try:
                wait_held(a.gate, held + 7)  # every one of them is mid-way, held by A's gate
            except AssertionError as exc:
                raise AssertionError(f"{exc}\nrefused: {REFUSED}\n{_claims(cluster)}") from None
            sent = logged_events(cluster, "killed")
            head = b""
            pieces = stream.iter_raw()
            while head.count(b"\n\n") < sent:
                head += next(pieces)
            a.kill()
            killed_at = time.monotonic()
    yield Killed(head, created.json()["id"], killed_at)


REFUSED: dict[str, str] = {}  # requests sent in the background that A answered at once with an error


def _start_in_background(url: str, body: dict[str, Any], request_id: str) -> None:
    """Send a request to A and leave it: its generation runs (and is held) on A."""

    def send() -> None:
        with contextlib.suppress(httpx.HTTPError):  # cut when A is killed
            answer = httpx.post(
                f"{url}/v1/chat/completions", json=body, headers=identified(request_id), timeout=600
            )
            if answer.status_code != 200:
                REFUSED[request_id] = answer.text

    threading.Thread(target=send, daemon=True).start()


def _claims(cluster: Cluster) -> str:
    """Each claim and its log's length in the store (for a failure's message)."""
    import redis

    client = redis.Redis.from_url(cluster.redis.url)
    lines = [
        f"{key.decode()}: {client.get(key)!r} events={client.xlen(key.replace(b'claim', b'events'))}"
        for key in client.scan_iter("bundle:claim:*")
    ]
    client.close()
    return "\n".join(lines)


def _story_schema() -> dict[str, Any]:
    # On the tiny model its string runs to max_tokens (checked): still mid-way when A is held.
    schema = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}
    return {"type": "json_schema", "json_schema": {"name": "story", "schema": schema}}


async def test_a_stream_of_a_killed_replica_resumes_on_b_as_if_nothing_happened(
    cluster: Cluster, killed: Killed
) -> None:
    b = cluster.b
    reference = await cluster.reference(story())
    before = b.metric("bundle_takeovers_total", 'outcome="continued"')
    # At once: B follows A until A's heartbeat lapses, then takes the generation over.
    async with streaming(b.url, story(), "killed", last_event_id=len(sse_events(killed.chat_head))) as on_b:
        tail = await on_b.rest()
    whole = killed.chat_head + tail
    whole_and_numbered(whole)
    assert text_of(whole) == text_of(reference)
    assert usage_of(whole) == usage_of(reference)  # the prompt once, every completion token once
    claim = await cluster.store().get("killed")
    assert claim is not None and (claim.epoch, claim.state) == (1, "completed")  # taken over once
    # (B may also have adopted the background Response meanwhile: at least this one.)
    assert b.metric("bundle_takeovers_total", 'outcome="continued"') - before >= 1
    assert b.metric("bundle_takeover_seconds_count") >= 1 and b.metric("bundle_continued_tokens_total") > 0


async def test_a_background_response_of_a_killed_replica_completes_by_itself(
    cluster: Cluster, killed: Killed
) -> None:
    # The Responses API's chat request: the same prompt, no ignore_eos.
    reference = await cluster.reference(story(ignore_eos=False))
    with openai.OpenAI(base_url=f"{cluster.c_url}/v1", api_key="unused", max_retries=0, timeout=120) as sdk:
        deadline = time.monotonic() + 120
        while (response := sdk.responses.retrieve(killed.response_id)).status in ("queued", "in_progress"):
            assert time.monotonic() < deadline, response
            await asyncio.sleep(0.5)
    assert response.status in ("completed", "incomplete")
    assert response.output_text == text_of(reference)
    assert response.usage is not None
    assert response.usage.output_tokens == usage_of(reference)["completion_tokens"]
    assert response.usage.input_tokens == usage_of(reference)["prompt_tokens"]


async def test_of_two_replicas_resuming_at_once_exactly_one_continues(cluster: Cluster, killed: Killed) -> None:
    reference = await cluster.reference(story())
    await asyncio.sleep(max(0.0, killed.killed_at + PRODUCER_LOST_BOUND_S - time.monotonic()))
    async with httpx.AsyncClient(timeout=120) as client:
        answers = await asyncio.gather(
            *(
                client.post(f"{url}/v1/chat/completions", json=story(), headers=identified("race", 0))
                for url in (cluster.b.url, cluster.c_url, cluster.b.url, cluster.c_url)
            )
        )
    assert all(answer.status_code == 200 for answer in answers)
    assert len({answer.content for answer in answers}) == 1
    whole_and_numbered(answers[0].content)
    assert text_of(answers[0].content) == text_of(reference)
    claim = await cluster.store().get("race")
    assert claim is not None and (claim.epoch, claim.state) == (1, "completed")  # taken over once


@pytest.mark.parametrize("request_id", ["structured", "n2"])
async def test_structured_output_and_n2_end_with_the_documented_error_never_wrong(
    cluster: Cluster, killed: Killed, request_id: str
) -> None:
    body = story(response_format=_story_schema()) if request_id == "structured" else N2
    async with streaming(cluster.b.url, body, request_id, last_event_id=0) as on_b:
        raw = await on_b.rest()
    events = sse_events(raw)
    error = orjson.loads(events[-2][1])["error"]
    assert error["code"] == "producer_lost" and "cannot be continued exactly" in error["message"]
    assert events[-1][1] == b"[DONE]" and ids_of(raw) == list(range(1, len(events) + 1))
    logged = read_log(*(await cluster.store().log(request_id)))
    assert logged.end == "failed" and len(logged.events) == len(events)  # nothing but A's, then the end


async def test_a_cog_prediction_of_a_killed_replica_continues_with_the_same_request_id(
    cluster: Cluster, killed: Killed
) -> None:
    body = cog_body(cluster)
    async with httpx.AsyncClient(timeout=120) as client:  # the uninterrupted answer, on B
        answer = await client.post(
            f"{cluster.b.url}/v1/chat/completions",
            json=body.model_dump(mode="json", exclude_unset=True, by_alias=True),
            headers=identified("cog-reference"),
        )
    expected = answer.json()["choices"][0]["message"]["content"]

    async def predict() -> str:
        subscription = await bridge.start_generation(cluster.c, body, "cog-prediction")
        try:
            return "".join([piece async for piece in subscription.text()])
        finally:
            subscription.close()

    assert cluster.live.call(predict(), timeout=300) == expected


async def test_a_replica_killed_during_its_takeover_is_taken_over_in_turn(
    cluster: Cluster, killed: Killed
) -> None:
    b = cluster.b
    reference = await cluster.reference(story())
    from_a = await asyncio.to_thread(logged_events, cluster, "taken-twice")
    b.gate.set(10)  # B passes its continuation's first outputs, up to 10 tokens, then holds
    held = b.gate.held()
    async with streaming(b.url, story(), "taken-twice", last_event_id=0) as on_b:
        await asyncio.to_thread(wait_held, b.gate, held + 1)
        head = await on_b.events(from_a + 1)  # A's events, then B's first
        b.kill()
    last = len(sse_events(head))
    async with streaming(cluster.c_url, story(), "taken-twice", last_event_id=last) as on_c:
        tail = await on_c.rest()
    whole = head + tail
    whole_and_numbered(whole)
    assert text_of(whole) == text_of(reference) and usage_of(whole) == usage_of(reference)
    claim = await cluster.store().get("taken-twice")
    assert claim is not None and (claim.epoch, claim.state) == (2, "completed")


# --- the seam inside a character, on the real engine ------------------------------------------------
def test_a_continuation_whose_seam_falls_inside_a_character_joins_exactly(live: LiveServers) -> None:
    """The tiny model's greedy text for this prompt has tokens that end inside a UTF-8 character
    (vLLM streams nothing for them until the next token completes it). Cut right there, the log
    holds one id more than the text sent; the plan ends the prompt before it, and the engine's
    continuation joins the text sent exactly (tests/test_takeover_seam.py: the same without an
    engine)."""
    engine: Any = live.engine
    prompt = engine.render_chat([{"role": "user", "content": PROMPT}])

    async def generate(ids: list[int], max_tokens: int) -> tuple[str, list[int]]:
        request = SamplingRequest(prompt_token_ids=ids, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        text, tokens = "", list[int]()
        async for delta in engine.generate(f"seam-{len(ids)}-{time.monotonic_ns()}", request):
            text, tokens = text + delta.text, tokens + list(delta.token_ids)
        return text, tokens

    whole, ids = live.call(generate(prompt, TOKENS))
    steps = engine.decode_steps(prompt, ids, True)
    inside = [index for index, piece in enumerate(steps) if piece is None]
    assert inside, "no token of this output ends inside a character: pick another prompt"
    for cut in inside[:3]:
        sent = "".join(piece or "" for piece in steps[:cut])  # what vLLM had streamed
        made = Recipe("chat", "c", 1, "tiny", True, False, prompt, {"max_tokens": TOKENS})
        logged = read_log([], made.encode())
        logged.text, logged.ids = sent, ids[: cut + 1]  # the id inside the character was logged
        found = plan(logged, engine.decode_steps(prompt, logged.ids, True))
        assert (found.kept, found.resent) == (cut, "")
        rest, _ = live.call(generate(prompt + ids[:cut], TOKENS - cut))
        assert sent + rest == whole
