"""`python -m bench.store_writes`: what appending a flush of events costs the API process.

The shared identity store (shared/replicas/store.py) appends every event of a flush with one script
call. This compares that with the obvious alternative, one XADD per event in a pipeline, on the
same local valkey-server and the same events, reporting the client's CPU per event (the cost
that lands on the API process's one event loop) and the wall time per flush. The script's calls
are built as the writer builds them with takeover on (BUNDLE_TAKEOVER, the default): each
stream's writes fenced by its claim, each event carrying its token id.

    python -m bench.store_writes --streams 1,16,256
"""

from __future__ import annotations

import argparse
import asyncio
import time

from redis.asyncio import Redis

from bench.redis_overhead import local_store
from shared.redis_client import redis_client
from shared.replicas.store import APPEND_SCRIPT, Claim
from shared.replicas.store_keys import claim_key
from shared.replicas.tokens import pack_ids

EVENT = b'{"id":"cmpl-0123456789abcdef","object":"text_completion","choices":[{"index":0,"text":" word"}]}'


async def by_pipeline(client: Redis, keys: list[str], sequence: int, sha: str) -> None:
    async with client.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.xadd(key, {b"d": EVENT}, id=f"{sequence}-0", maxlen=16384, approximate=True)
        await pipe.execute()


CLAIM = Claim("fingerprint", "replica", True).encode()
TOKEN = pack_ids([1234])


async def by_script(client: Redis, keys: list[str], sequence: int, sha: str) -> None:
    """APPEND_SCRIPT's layout (see shared/replicas/store.py): per stream its id, its claim and
    its header, then one event (data, token ids)."""
    args: list[bytes | int | str] = [16384, 600_000, len(keys)]
    for key in keys:
        args += [key, CLAIM, f"{sequence} 1 0 d 0 0 0", EVENT, TOKEN]
    await client.evalsha(sha, 0, *args)


async def claimed(client: Redis, keys: list[str]) -> None:
    """The claims the script's writes are fenced by, as a running generation's."""
    for key in keys:
        await client.set(claim_key(key), CLAIM)


async def measure(url: str, streams: list[int], flushes: int) -> None:
    client = redis_client(url)  # as the store builds its client
    sha = await client.script_load(APPEND_SCRIPT)  # as the store calls it: by hash
    try:
        for count in streams:
            keys = [f"bench-{count}-{i}" for i in range(count)]
            for name, write in (("pipeline", by_pipeline), ("script", by_script)):
                await claimed(client, keys)
                cpu, wall = time.process_time(), time.perf_counter()
                for sequence in range(1, flushes + 1):
                    await write(client, keys, sequence, sha)
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                print(
                    f"{count:5d} streams  {name:8s}  {1e6 * cpu / (flushes * count):7.1f} us CPU per event  "
                    f"{1e3 * wall / flushes:6.2f} ms per flush",
                    flush=True,
                )
                await client.flushdb()
    finally:
        await client.aclose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.store_writes", description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", default="1,16,256", help="streams with one event each per flush")
    parser.add_argument("--flushes", type=int, default=200)
    parser.add_argument("--redis-url", help="use this server instead of starting a valkey-server")
    args = parser.parse_args(argv)
    streams = [int(count) for count in args.streams.split(",")]
    with local_store(args.redis_url) as url:
        asyncio.run(measure(url, streams, args.flushes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
