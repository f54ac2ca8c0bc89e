"""How long the engine's outputs wait for the API process, from vLLM's own timestamps.

vLLM's engine core stamps each step's outputs (`EngineCoreOutputs.timestamp`, the monotonic
clock, which every process on one machine shares) before sending them to the API process,
whose output handler takes them up when its event loop gets round to it, turns them into
per-request outputs in chunks and then asks for the next step's. The event loop also serves
HTTP: every token of every stream is written from it. When that work crowds the loop, each
step's tokens, first tokens included, reach the streams later, however fast the GPU is; these
two figures say how much:

- wait: from the engine stamping a step's outputs to the handler taking them up;
- handling: from taking them up to asking for the next step's (processing, and the loop's
  other work between chunks).

Both come from one wrapper around the engine client's `get_output_async`, the call vLLM's
output handler makes once per step. A vLLM without that method or stamp leaves them at zero,
and says so at start (`wrapped`, reported by shared/engine/vllm_features.py).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Tally:
    """A running sum and count (seconds), read as a Prometheus summary; `observe` as a
    histogram's, so that `shared.obs.loop_lag` can feed one too (the benchmark's client lag)."""

    seconds: float = 0.0
    count: int = 0

    def observe(self, seconds: float) -> None:
        self.seconds += seconds
        self.count += 1

    def reading(self) -> tuple[float, int]:
        """(sum, count), as a histogram's are read."""
        return self.seconds, self.count


@dataclass
class OutputTimings:
    wait: Tally = field(default_factory=Tally)
    handling: Tally = field(default_factory=Tally)
    wrapped: bool = False  # whether the engine client's fetch is timed at all
    _taken_at: float | None = None  # when the handler took up the last step's outputs

    def taken(self, stamped_at: float, now: float) -> None:
        if stamped_at > 0.0:
            self.wait.observe(max(0.0, now - stamped_at))
        self._taken_at = now

    def asking_again(self, now: float) -> None:
        if self._taken_at is not None:
            self.handling.observe(now - self._taken_at)
            self._taken_at = None


def time_engine_outputs(llm: Any) -> OutputTimings:
    """Wrap `llm`'s engine client so that each step's outputs are timed (see the module doc)."""
    timings = OutputTimings()
    client = getattr(llm, "engine_core", None)
    fetch: Callable[[], Awaitable[Any]] | None = getattr(client, "get_output_async", None)
    if client is None or fetch is None:
        return timings

    async def fetch_timed() -> Any:
        timings.asking_again(time.monotonic())
        outputs = await fetch()
        timings.taken(float(getattr(outputs, "timestamp", 0.0) or 0.0), time.monotonic())
        return outputs

    # An instance attribute: vLLM's output handler looks the method up on each call.
    try:
        client.get_output_async = fetch_timed
    except AttributeError:  # a client class that forbids it: serve untimed rather than not at all
        return OutputTimings()
    timings.wrapped = True
    return timings
