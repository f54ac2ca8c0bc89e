"""Two ways to spend less of the event loop per streamed token, through the whole bundle on the
real engine (tiny model):
- BUNDLE_STREAM_INTERVAL: vLLM hands a stream's tokens out in groups after the first; the bundle
  must turn each group into one chunk, lose nothing and count every token (the official SDK).
- BUNDLE_STREAM_BATCH_AT: under load a new stream's tokens come in pairs after the first, from
  vLLM's per-request stream interval (the bundle's paired writes, for a vLLM without one, are
  unit-tested in tests/test_core_units.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.conftest import LiveServers
from tests.gate import Gate
from tests.real_server import ServerProcess, bundle_server

TOKENS = 13  # 1 + 4 + 4 + 4 with an interval of 4: the first token alone, then full groups


@pytest.fixture(scope="module")
def chunked_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with bundle_server(tmp_path_factory.mktemp("stream-interval"), stream_interval="4") as server:
        yield server


def test_tokens_arrive_in_groups_of_the_interval_and_none_is_lost(chunked_server: ServerProcess) -> None:
    sdk = openai.OpenAI(base_url=f"{chunked_server.url}/v1", api_key="none", max_retries=0)

    def complete(stream: bool) -> Any:  # the same request both ways; greedy, so the same tokens
        return sdk.completions.create(
            model="tiny",
            prompt="Once upon",
            max_tokens=TOKENS,
            temperature=0.0,
            logprobs=1,  # a chunk's logprobs list its tokens: how many each chunk carried
            stream=stream,
            stream_options={"include_usage": True} if stream else openai.omit,
            extra_body={"ignore_eos": True},
        )

    whole = complete(stream=False)
    chunks = list(complete(stream=True))
    choices = [chunk.choices[0] for chunk in chunks if chunk.choices]
    tokens_per_chunk = [len(choice.logprobs.tokens) for choice in choices]
    # The first token alone, then groups of 4 (two groups may share a chunk when the bundle's
    # reader of the engine is late: vLLM merges what is waiting, with or without an interval).
    assert tokens_per_chunk[0] == 1 and sum(tokens_per_chunk) == TOKENS, tokens_per_chunk
    assert all(count % 4 == 0 for count in tokens_per_chunk[1:]), tokens_per_chunk
    assert "".join(choice.text for choice in choices) == whole.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == TOKENS
    assert choices[-1].finish_reason == "length"


def test_under_load_vllm_hands_a_new_streams_tokens_out_in_pairs_and_nothing_is_lost(
    live: LiveServers, gate: Gate
) -> None:
    url, service = live.serve(stream_batch_at=1)  # one stream being written is "load"
    assert not service.pacing.pairs_writes  # vLLM 0.32 paces each request: the writes are not held too
    body = {
        "model": "tiny",
        "prompt": "Once upon",
        "max_tokens": 9,
        "ignore_eos": True,
        "temperature": 0.0,
        "logprobs": 1,  # a chunk's logprobs list its tokens: how many each chunk carried
    }
    with httpx.Client(base_url=url, timeout=60) as client, gate.hold(after=1) as held:
        whole = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        # A load held after its first delta (tests/gate.py): it runs until the request below
        # has ended, however fast the engine; ended by closing it.
        load = {**body, "prompt": held.prompt("Once upon"), "max_tokens": 1500, "stream": True}
        with client.stream("POST", "/v1/completions", json=load) as busy:
            assert busy.status_code == 200, busy.read()
            # Its first token is out: it runs while the next one is admitted. The iterator is
            # kept: a generator dropped after one `next` is closed, and closing it closes the
            # connection, so the server aborted the load as a disconnect, racing the admission
            # below (every token alone in some fresh-clone runs).
            load_chunks = busy.iter_raw()
            next(load_chunks)
            held.wait_held()
            with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as reply:
                assert reply.status_code == 200
                received = reply.read()
            assert service.registry.running == 1  # the load still runs: it was running at admission
            load_chunks.close()
    events = [line[6:] for line in received.split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    choices = [orjson.loads(event)["choices"][0] for event in events[:-1]]
    tokens_per_chunk = [len(choice["logprobs"]["tokens"]) for choice in choices]
    # The first token alone, then pairs (vLLM may merge waiting pairs into one delta).
    assert tokens_per_chunk[0] == 1 and sum(tokens_per_chunk) == 9, tokens_per_chunk
    assert all(count % 2 == 0 for count in tokens_per_chunk[1:]), tokens_per_chunk
    assert "".join(choice["text"] for choice in choices) == whole


def test_direct_writes_carry_every_event_in_order_and_a_resume_gets_the_same_tail(
    live: LiveServers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """BUNDLE_STREAM_DIRECT_WRITES through uvicorn's httptools protocol on the real engine: the
    event log writes a caught-up stream's events onto its connection itself (counted here), and a
    client sees what the ASGI path sends: every event, numbered in order, the same text as the
    whole answer, and a resume from event 3 gets exactly the tail."""
    from shared.generation.replay import ReplayBuffer

    written = []
    write_to_sink = ReplayBuffer._write_to_sink

    def counting(self: ReplayBuffer, sink: Any, event: bytes) -> None:
        written.append(event)
        write_to_sink(self, sink, event)

    monkeypatch.setattr(ReplayBuffer, "_write_to_sink", counting)
    url, _ = live.serve(stream_direct_writes=True)
    body = {"model": "tiny", "prompt": "Once upon", "max_tokens": 12, "ignore_eos": True, "temperature": 0.0}
    headers = {"X-Request-Id": "direct-writes-1", "Accept": "text/event-stream"}
    with httpx.Client(base_url=url, timeout=60) as client:
        whole = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        streamed = client.post("/v1/completions", json={**body, "stream": True}, headers=headers)
        resumed = client.post(
            "/v1/completions", json={**body, "stream": True}, headers={**headers, "Last-Event-ID": "3"}
        )
    assert streamed.status_code == resumed.status_code == 200
    assert written, "no event took the direct write"
    events = [block for block in streamed.content.split(b"\n\n") if block]
    ids = [int(block.split(b"\n")[0][4:]) for block in events]
    assert ids == list(range(1, len(events) + 1)) and events[-1].endswith(b"data: [DONE]")
    texts = [orjson.loads(block.split(b"\n")[1][6:])["choices"][0]["text"] for block in events[:-1]]
    assert "".join(texts) == whole
    assert resumed.content == b"".join(block + b"\n\n" for block in events[3:])
