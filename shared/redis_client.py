"""The one way to build a Redis (or Valkey) client: every user of BUNDLE_REDIS_URL calls `redis_client`.

The identity store (shared/replicas/store.py) and the Responses API's store
(shared/responses/records.py) share one server; built here, they fail and recover the same way.
redis-py is imported inside the function, so a process with no store configured never loads it.

At full load (hundreds of requests with ids admitted in one burst) two of redis-py's defaults
fail requests while the store is up (tests/test_store_load.py shows both):
- Its default pool holds at most 100 connections and raises MaxConnectionsError past them
  instead of waiting: a burst of 256 claims in one process fails ~40 % of them. The pool here
  is bounded and *blocking*: a command waits for a free connection, it never fails for want of
  one. A loopback round trip takes ~0.1 ms, so a few dozen connections carry thousands of
  commands a second.
- Its timeouts run on the event loop's clock, so an API process whose own loop is busy for a
  second (a burst of new streams, a long collection) trips them while the store answered long
  before. `answer_bound` replaces them: it fails a round trip only when the store gave no
  answer to this process for that long while the loop itself ran on time.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from redis.asyncio import Redis

# A server that does not accept the connection in this long is down (a refused connection fails
# at once; this only ends a connect to a host that does not answer at all). Generous: the
# process's own loop may be slow to run the connect's callback under a burst.
CONNECT_TIMEOUT_S = 10.0
# redis-py's own read timeout, a last resort far above `answer_bound`'s (which ends a round trip
# first): only a loop stalled this long could trip it wrongly.
SOCKET_TIMEOUT_S = 60.0
# One retry, without back-off, on a connection or timeout error: it replaces a pooled connection
# that died with a restarted server (without it, the first command on each such connection fails),
# and still fails fast while the server is down.
RETRIES = 1
# Connections per pool: the most commands one process has in flight at once. Past it, commands
# wait in order for a connection (BlockingConnectionPool), never fail.
POOL_CONNECTIONS = 64
# A timer that fires this much later than asked found the loop busy elsewhere: the time it was
# away does not count against the store.
LOOP_LATE_S = 0.1


def redis_client(url: str, connections: int = POOL_CONNECTIONS, *, waiting: bool = True) -> Redis:
    """An asyncio client for `url` on a bounded, waiting pool; connections open lazily.
    `waiting=False`: redis-py's plain pool, for a client whose one connection is a PubSub's (its
    teardown releases the connection through the pool, and a waiting pool's release takes a lock
    that a cancelled PubSub's uncancellable teardown must not depend on)."""
    from redis.asyncio import BlockingConnectionPool, ConnectionPool, Redis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    options = {
        "max_connections": connections,
        "retry": Retry(NoBackoff(), RETRIES),
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        "socket_timeout": SOCKET_TIMEOUT_S,
    }
    if waiting:  # wait for a connection as long as the store answers (`answer_bound`)
        pool: ConnectionPool = BlockingConnectionPool.from_url(url, timeout=None, **options)
    else:
        pool = ConnectionPool.from_url(url, **options)
    return Redis.from_pool(pool)  # the client owns the pool: closing it closes the pool


class AnswerClock:
    """Counts the answers one process got from the store: a round trip still waiting while others
    are answered is queued or slow, not facing a dead store."""

    def __init__(self) -> None:
        self.answers = 0

    def answered(self) -> None:
        self.answers += 1


@contextlib.asynccontextmanager
async def answer_bound(
    seconds: float, clock: AnswerClock, on_slow: Callable[[], None] = lambda: None
) -> AsyncIterator[None]:
    """Raise TimeoutError when the block runs `seconds` with no answer from the store to this
    process, counted only while the event loop ran on time. Each time the bound is reached it
    looks back: if the store answered anything meanwhile (this round trip was queued behind
    others, or the store is slow), or the timer itself ran late (this process's loop was busy,
    the answer may be waiting in the socket), it starts again and calls `on_slow`; otherwise the
    store is taken for unreachable."""
    loop = asyncio.get_running_loop()
    seen = clock.answers
    handle: asyncio.TimerHandle | None = None
    async with asyncio.timeout(None) as timeout:

        def check(deadline: float) -> None:
            nonlocal seen
            now = loop.time()
            late = now - deadline
            if clock.answers == seen and late <= LOOP_LATE_S:
                timeout.reschedule(now)  # expires at once: the block gets TimeoutError
                return
            seen = clock.answers
            on_slow()
            arm(now + (seconds if late <= LOOP_LATE_S else late))

        def arm(deadline: float) -> None:
            nonlocal handle
            handle = loop.call_at(deadline, check, deadline)

        arm(loop.time() + seconds)
        try:
            yield
        finally:
            assert handle is not None
            handle.cancel()
