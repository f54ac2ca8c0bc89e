"""How late the API's event loop runs a timer: the time every request and every token waits for
the loop when it is busy (parsing, encoding, other streams' events).

A few milliseconds is a loop with room; tens of milliseconds at high concurrency means the API
process, not the engine, sets time to first token (docs/performance.md)."""

from __future__ import annotations

import asyncio
from typing import Protocol

LAG_INTERVAL_S = 0.1  # one timer per 100 ms: negligible work, enough samples per benchmark level


class LagObserver(Protocol):
    """Where the lateness goes: the server's Prometheus histogram, or the benchmark's tally."""

    def observe(self, amount: float) -> None: ...


async def watch_loop_lag(lag: LagObserver, interval_s: float = LAG_INTERVAL_S) -> None:
    """Until cancelled: sleep `interval_s`, record how much later than asked the loop woke us."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + interval_s
        await asyncio.sleep(interval_s)
        lag.observe(max(0.0, loop.time() - due))
