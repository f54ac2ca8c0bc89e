"""A burst of streamed requests with ids, some sent twice: does request identity hold at full load?

`python -m bench.identity_burst --url A [--url B] --streams 256 --duplicates 64` sends `streams`
streamed chat completions at once, each under its own `X-Request-Id`, spread over the URLs in
turn; and, at the same moment, `duplicates` more that repeat the ids (and bodies) of the first
ones, each to the next URL after its original (with one URL: the same one, i.e. any of its API
processes). It reports the non-2xx answers with their messages, the ids whose clients received
different bytes, and how many engine generations the servers started meanwhile (the sum of
`bundle_engine_generations_total` over the URLs: one per id is the promise).

Sampled at temperature 1 without a seed, so two generations of one id would (almost surely)
differ: a second generation shows as different bytes, not only in the count.
tests/test_full_load.py asserts on it; on a GPU it runs beside `vllm bench serve`.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import orjson

GENERATIONS = "bundle_engine_generations_total"


@dataclass
class BurstResult:
    requests: int
    ids: int
    statuses: dict[int, int]  # status -> count
    failures: list[str] = field(default_factory=list)  # "status: message" of each non-2xx (first 20)
    differing_ids: list[str] = field(default_factory=list)  # ids whose clients got different bytes
    generations: float = 0.0  # engine generations started during the burst (all URLs)
    seconds: float = 0.0

    @property
    def non_2xx(self) -> int:
        return sum(count for status, count in self.statuses.items() if not 200 <= status < 300)


ROUTES = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


def body(kind: str, max_tokens: int, index: int) -> dict[str, Any]:
    """A streamed request of `kind` ("chat", or "completion": no chat template needed)."""
    text = f"burst {index}: tell me a story"
    prompt = {"messages": [{"role": "user", "content": text}]} if kind == "chat" else {"prompt": text}
    return {
        "model": "tiny",
        **prompt,
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "ignore_eos": True,
        "stream": True,
    }


def generations(urls: list[str]) -> float:
    """The sum of the engine-generation counters that the servers report on /metrics."""
    total = 0.0
    for url in dict.fromkeys(urls):
        text = httpx.get(f"{url}/metrics", timeout=30).text
        total += sum(float(v) for v in re.findall(rf"^{GENERATIONS}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))
    return total


async def _one(
    client: httpx.AsyncClient, url: str, request: dict[str, Any], request_id: str
) -> tuple[int, bytes]:
    headers = {"X-Request-Id": request_id, "Accept": "text/event-stream"}
    route = ROUTES["chat" if "messages" in request else "completion"]
    async with client.stream("POST", f"{url}{route}", json=request, headers=headers) as response:
        return response.status_code, await response.aread()


async def burst(
    urls: list[str],
    streams: int,
    duplicates: int,
    max_tokens: int = 16,
    prefix: str = "burst",
    kind: str = "chat",
) -> BurstResult:
    """Send the burst (module docstring) and wait for every answer. The generation count is read
    before and after: it is exact only where nothing else runs on the servers meanwhile."""
    assert 0 <= duplicates <= streams and urls
    before = await asyncio.to_thread(generations, urls)
    run = f"{prefix}-{time.monotonic_ns():x}"
    sends: list[tuple[str, str, dict[str, Any]]] = []  # (url, id, body)
    for index in range(streams):
        sends.append((urls[index % len(urls)], f"{run}-{index}", body(kind, max_tokens, index)))
    for index in range(duplicates):
        sends.append((urls[(index + 1) % len(urls)], f"{run}-{index}", body(kind, max_tokens, index)))
    limits = httpx.Limits(max_connections=len(sends), max_keepalive_connections=0)
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=60), limits=limits) as client:
        answers = await asyncio.gather(*(_one(client, url, request, rid) for url, rid, request in sends))
    seconds = time.monotonic() - started
    after = await asyncio.to_thread(generations, urls)
    result = BurstResult(len(sends), streams, dict(Counter(status for status, _ in answers)), seconds=seconds)
    result.generations = after - before
    by_id: dict[str, set[bytes]] = {}
    for (_, rid, _), (status, content) in zip(sends, answers, strict=True):
        if not 200 <= status < 300:
            if len(result.failures) < 20:
                result.failures.append(f"{status}: {_message(content)}")
            continue
        by_id.setdefault(rid, set()).add(content)
    result.differing_ids = sorted(rid for rid, bodies in by_id.items() if len(bodies) > 1)
    return result


def _message(content: bytes) -> str:
    try:
        return str(orjson.loads(content)["error"]["message"])[:300]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return content[:300].decode(errors="replace")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", action="append", required=True, help="a server (repeat for replicas)")
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--duplicates", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--kind", choices=tuple(ROUTES), default="chat")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", help="write every round's result here (JSON)")
    args = parser.parse_args(argv)
    if not 0 <= args.duplicates <= args.streams:
        parser.error("--duplicates must be between 0 and --streams")
    rounds = [
        asyncio.run(burst(args.url, args.streams, args.duplicates, args.max_tokens, f"r{n}", args.kind))
        for n in range(args.rounds)
    ]
    report = [
        {**asdict(r), "statuses": {str(k): v for k, v in r.statuses.items()}, "non_2xx": r.non_2xx}
        for r in rounds
    ]
    text = orjson.dumps(
        {"streams": args.streams, "duplicates": args.duplicates, "rounds": report}, option=orjson.OPT_INDENT_2
    )
    if args.out:
        with open(args.out, "wb") as out:
            out.write(text)
    print(text.decode())
    return 0 if all(r.non_2xx == 0 and not r.differing_ids for r in rounds) else 1


if __name__ == "__main__":
    sys.exit(main())
