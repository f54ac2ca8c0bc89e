"""The one way to build a Redis (or Valkey) client: every user of BUNDLE_REDIS_URL calls `redis_client`.

The identity store (shared/identity/store.py) and the Responses API's store
(shared/responses/store.py) share one server; built here, they fail and recover the same way.
redis-py is imported inside the function, so a process with no store configured never loads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from redis.asyncio import Redis

# A server that does not accept the connection within a second is down for this request: fail
# fast (503) rather than hold the client for redis-py's default of five.
CONNECT_TIMEOUT_S = 1.0
# Above the longest blocking read any user makes (the identity store's XREAD BLOCK, 1 s), so a
# slow answer is not mistaken for a dead server.
SOCKET_TIMEOUT_S = 5.0
# One retry, without back-off, on a connection or timeout error: it replaces a pooled connection
# that died with a restarted server (without it, the first command on each such connection fails),
# and still fails fast while the server is down.
RETRIES = 1


def redis_client(url: str) -> Redis:
    """An asyncio client for `url`; connections open lazily, on the first command."""
    from redis.asyncio import Redis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    return Redis.from_url(
        url,
        retry=Retry(NoBackoff(), RETRIES),
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        socket_timeout=SOCKET_TIMEOUT_S,
    )
