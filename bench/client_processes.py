"""One level over HTTP from several client processes.

One Python client parsing ~10k events/s is itself near saturation; at high concurrency the
load is split over processes so that the numbers describe the server, not the client.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import asdict
from typing import Any

from bench.loadgen import Sample, gather_limited, loop_lag_watched, summarise, with_client_lag
from bench.requesters import http_requester, load_client, open_connections
from bench.workload import Workload
from shared.obs.engine_outputs import Tally


def run_level_in_processes(
    pool: Any,
    url: str,
    workload: Workload,
    prompts: list[list[int]],
    concurrency: int,
    clients: int,
    api_key: str | None = None,
    request_ids: bool = False,
) -> dict[str, Any]:
    clients = max(1, min(clients, concurrency))
    start_at = time.time() + 3.0  # every process starts its share at the same instant
    arrivals = workload.arrival_offsets(prompts)  # an open loop: each process sends its share on time
    thinks = workload.think_times(prompts)
    futures = [
        pool.submit(
            _client_process,
            url,
            workload,
            prompts[i::clients],
            -(-concurrency // clients),
            start_at,
            api_key,
            request_ids,
            arrivals[i::clients] if arrivals is not None else None,
            thinks[i::clients] if thinks is not None else None,
        )
        for i in range(clients)
    ]
    parts = [future.result() for future in futures]
    samples = [Sample(**fields) for rows, _, _ in parts for fields in rows]
    wall = max(end for _, end, _ in parts) - start_at
    lag = Tally(sum(seconds for *_, (seconds, _) in parts), sum(count for *_, (_, count) in parts))
    return with_client_lag(summarise(concurrency, samples, wall), lag)


# BENCH_CLIENT_CPUS=12-15 (taskset's list syntax): the client processes run on these CPUs only,
# off those of the server and engine, which here share one machine with them (never in production).
CLIENT_CPUS = "BENCH_CLIENT_CPUS"


def cpu_list(text: str) -> set[int]:
    """ "0-3,8" -> {0, 1, 2, 3, 8}."""
    cpus: set[int] = set()
    for part in filter(None, text.replace(" ", "").split(",")):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def _client_process(
    url: str,
    workload: Workload,
    prompts: list[list[int]],
    concurrency: int,
    start_at: float,
    api_key: str | None,
    request_ids: bool,
    arrivals: list[float] | None,
    thinks: list[float] | None,
) -> tuple[list[dict[str, Any]], float, tuple[float, int]]:
    if os.environ.get(CLIENT_CPUS):
        os.sched_setaffinity(0, cpu_list(os.environ[CLIENT_CPUS]))
    share = _client_share(url, workload, prompts, concurrency, start_at, api_key, request_ids, arrivals, thinks)
    return asyncio.run(share)


async def _client_share(
    url: str,
    workload: Workload,
    prompts: list[list[int]],
    concurrency: int,
    start_at: float,
    api_key: str | None,
    request_ids: bool,
    arrivals: list[float] | None,
    thinks: list[float] | None,
) -> tuple[list[dict[str, Any]], float, tuple[float, int]]:
    """This process's samples, when it finished, and how late its loop ran (seconds, samples)."""
    async with load_client(url) as client:
        one = http_requester(client, workload, api_key, request_ids=request_ids)
        await open_connections(client, concurrency, api_key)
        await asyncio.sleep(max(0.0, start_at - time.time()))
        async with loop_lag_watched() as lag:
            samples = await gather_limited(one, prompts, concurrency, arrivals, thinks)
        end = time.time()
    return [asdict(s) for s in samples], end, (lag.seconds, lag.count)
