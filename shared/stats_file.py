"""Publish the engine's own counts to a file, for hosts that expose no metrics endpoint.

Cog serves only its own routes, so a sidecar (or a test) that must know whether the engine
still holds requests reads this file instead. Written atomically, so readers never see half.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import orjson

from shared.engine import Engine


async def publish_engine_stats(engine: Engine, path: Path, interval_s: float) -> None:
    """Rewrite `path` with the engine's running-request count every `interval_s` until cancelled."""
    scratch = path.with_name(path.name + ".tmp")
    while True:
        snapshot = {"engine_running_requests": engine.running_requests(), "time": time.time()}
        scratch.write_bytes(orjson.dumps(snapshot))
        os.replace(scratch, path)
        await asyncio.sleep(interval_s)
