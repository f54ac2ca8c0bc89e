"""Round trips to the identity store: each one counted and timed for /metrics, bounded by the
store's silence, and failed as `StoreUnavailable` (HTTP 503) naming what went wrong.

A refused or broken connection fails at once; no answer fails only past ANSWER_BOUND_S of silence
from the store while this process's loop ran on time (shared/redis_client.py `answer_bound`): a
queued or slow round trip is counted as slow, never failed. redis-py reconnects on the next
command, so the bundle recovers without a restart when the server comes back.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.errors import StoreUnavailable
from shared.obs.metrics import Metrics
from shared.redis_client import AnswerClock, answer_bound

# No answer from the store to this process for this long, while its loop ran on time: unreachable.
ANSWER_BOUND_S = 5.0


class RoundTrips:
    """What every command to the identity store goes through (`trip`), with one clock per process
    that tells the store's silence from this loop's own lateness."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.clock = AnswerClock()

    @contextlib.asynccontextmanager
    async def trip(self, op: str, commands: int = 1, blocks_s: float = 0.0) -> AsyncIterator[None]:
        """One round trip: counted, timed, bounded (ANSWER_BOUND_S of silence, on top of a blocking
        read's own `blocks_s`), and failed as StoreUnavailable naming what went wrong."""
        self.metrics.store_round_trips.labels(op).inc()
        self.metrics.store_commands.labels(op).inc(commands)
        started = time.perf_counter()
        try:
            # ANSWER_BOUND_S is read here, at each trip, so that a test may shorten it.
            async with answer_bound(
                ANSWER_BOUND_S + blocks_s, self.clock, self.metrics.store_slow.labels(op).inc
            ):
                yield
        except (RedisError, OSError, TimeoutError) as exc:
            kind = error_kind(exc)
            self.metrics.store_errors.labels(op, kind).inc()
            raise StoreUnavailable(
                f"the shared request-identity store (Redis) is unavailable ({type(exc).__name__}: "
                f"{kind}); requests with X-Request-Id cannot be served now, requests without one can"
            ) from exc
        else:
            self.clock.answered()
        finally:
            self.metrics.store_latency.labels(op).observe(time.perf_counter() - started)


def error_kind(exc: BaseException) -> str:
    """What failed, for /metrics: `unreachable` (refused or broken connection), `no_answer`
    (ANSWER_BOUND_S of silence), or `error` (the store answered with an error)."""
    if isinstance(exc, TimeoutError | RedisTimeoutError):
        return "no_answer"
    if isinstance(exc, RedisConnectionError | OSError):
        return "unreachable"
    return "error"


def ms(seconds: float) -> int:
    """A duration as the milliseconds that PX and PEXPIRE take, never 0."""
    return max(int(seconds * 1000), 1)
