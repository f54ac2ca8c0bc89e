"""Python's garbage-collector thresholds while a service runs (BUNDLE_GC_THRESHOLDS).

After start-up the engine freezes the heap it leaves (shared/engine/vllm_startup.py), so the oldest
generation holds only what serving keeps alive: every running stream's objects, promoted there
while their requests last seconds. With Python's own thresholds (700, 10, 10) a full collection
walks all of them and stops the event loop meanwhile (`bundle_gc_pause_seconds`; on the H200 at
256 streams one to three a 20-second run, 30-47 ms each), which first tokens and inter-token
gaps wait behind. A larger third threshold makes full collections rarer; per-request garbage
caught in reference cycles (the web framework's and uvicorn's, a few dozen objects a request)
then waits longer to be freed (docs/performance.md, "Garbage collection").
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

Thresholds = tuple[int, int, int]


@contextmanager
def gc_thresholds(thresholds: Thresholds) -> Iterator[None]:
    """`thresholds` for the block; the process's own again after it (tests run many services)."""
    before = gc.get_threshold()
    gc.set_threshold(*thresholds)
    try:
        yield
    finally:
        gc.set_threshold(*before)
