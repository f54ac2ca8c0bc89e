"""The engine's prefix-cache counts (what the benchmark reads through the stats file) come from
the real engine: a prompt sent twice is found in the cache the second time."""

from __future__ import annotations

import random

import httpx

from shared.engine.contract import PrefixCacheCounts
from shared.engine.stats_file import engine_snapshot
from shared.service import Service


def _completion(http: httpx.Client, prompt: list[int]) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0.0}
    assert http.post("/v1/completions", json=body).status_code == 200


def test_a_repeated_prompt_is_counted_as_prefix_cache_hits(http: httpx.Client, service: Service) -> None:
    counts = service.engine.prefix_cache
    assert isinstance(counts, PrefixCacheCounts)
    prompt = [random.randrange(16, 1000) for _ in range(600)]  # several KV blocks, unseen before
    before = (counts.queries, counts.hits)
    _completion(http, prompt)
    first = (counts.queries - before[0], counts.hits - before[1])
    _completion(http, prompt)
    second = (counts.queries - before[0] - first[0], counts.hits - before[1] - first[1])
    assert first == (600, 0)
    assert second[0] == 600 and 0 < second[1] < 600  # the last partial block is recomputed
    snapshot = engine_snapshot(service.engine)
    assert (snapshot["prefix_cache_queries"], snapshot["prefix_cache_hits"]) == (counts.queries, counts.hits)
