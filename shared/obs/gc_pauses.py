"""How long Python's garbage collector stops this process, by generation.

A collection holds the GIL from start to end, so the event loop stops with it: every stream's
next token and every waiting admission wait for it. The engine freezes the heap that start-up
leaves (shared/engine/vllm_startup.py, `freeze_startup_heap`), so what a collection walks is what serving
itself keeps alive, and what it frees is per-request objects caught in reference cycles (the
server's, the web framework's and vLLM's). This histogram says how often and how long, so that
a tail in time to first token or inter-token latency can be laid beside it.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol


class PauseHistogram(Protocol):
    """A labelled histogram (prometheus_client's): one child per generation."""

    def labels(self, generation: str) -> _Observer: ...


class _Observer(Protocol):
    def observe(self, amount: float) -> None: ...


class _PauseTimer:
    """A `gc.callbacks` entry. Collections never overlap (each holds the GIL throughout), so one
    start time is enough whichever thread's allocation set one off."""

    def __init__(self, histogram: PauseHistogram) -> None:
        self._histogram = histogram
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        self._histogram.labels(str(info["generation"])).observe(time.perf_counter() - self._started)


@contextmanager
def gc_pauses_observed(histogram: PauseHistogram) -> Iterator[None]:
    """Observe every collection's pause into `histogram` while the block runs."""
    timer = _PauseTimer(histogram)
    gc.callbacks.append(timer)
    try:
        yield
    finally:
        gc.callbacks.remove(timer)
