"""Publish the engine's own counts to a file, for hosts that expose no metrics endpoint.

Cog serves only its own routes, so a sidecar (or a test) that must know whether the engine
still holds requests reads this file instead; the benchmark reads the prefix-cache counts from
it. Written atomically, so readers never see half.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import orjson

from shared.engine.contract import Engine


async def publish_engine_stats(engine: Engine, path: Path, interval_s: float) -> None:
    """Rewrite `path` with the engine's counts every `interval_s` until cancelled."""
    scratch = path.with_name(path.name + ".tmp")
    while True:
        scratch.write_bytes(orjson.dumps(engine_snapshot(engine)))
        os.replace(scratch, path)
        await asyncio.sleep(interval_s)


def engine_snapshot(engine: Engine) -> dict[str, Any]:
    snapshot: dict[str, Any] = {"engine_running_requests": engine.running_requests(), "time": time.time()}
    counts = engine.prefix_cache  # only vLLM's engine counts prefix-cache hits; test fakes have none
    if counts is not None:
        snapshot["prefix_cache_queries"] = counts.queries
        snapshot["prefix_cache_hits"] = counts.hits
    return snapshot
