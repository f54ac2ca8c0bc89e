"""The targets: raw `AsyncLLM` in-process, and any OpenAI-compatible server over HTTP."""

from __future__ import annotations

import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from bench.client_processes import run_level_in_processes
from bench.levels import NO_METERS, LevelRunner, Meters, run_levels
from bench.loadgen import Requester, run_level
from bench.requesters import engine_requester, http_requester, load_client, open_connections
from bench.servers import server_cpu_by_role
from bench.workload import Workload
from shared.engine.vllm_startup import batch_token_budget, import_engine_modules, start_llm, stop_llm
from shared.obs.engine_outputs import time_engine_outputs
from shared.settings import Settings

WARM_UP_REQUESTS = 4  # graphs, caches, connections; their prompts are a batch of their own


def scheduled(one: Requester, workload: Workload) -> LevelRunner:
    """A level runner for one process: the workload's arrival schedule (open loop) or none."""

    async def level(prompts: list[list[int]], concurrency: int) -> dict[str, Any]:
        arrivals, thinks = workload.arrival_offsets(prompts), workload.think_times(prompts)
        return await run_level(one, prompts, concurrency, arrivals, thinks)

    return level


def import_engine() -> None:
    """Import vLLM's engine before any frame that will hold one exists (see
    `shared.engine.vllm_startup.import_engine_modules`: otherwise `make bench` ended with an `AsyncLLM.__del__`
    traceback)."""
    import_engine_modules()


async def bench_raw(
    settings: Settings, workload: Workload, levels: list[int], rounds: int, repeat: int = 1
) -> dict[str, Any]:
    """The floor: the same engine the bundle builds, driven in-process with no server."""
    llm = start_llm(settings)
    try:
        one = engine_requester(llm, workload)
        await run_level(one, workload.prompts(WARM_UP_REQUESTS, "warm-up"), WARM_UP_REQUESTS)
        # process_time: this process's CPU, where vLLM's client side (output handling,
        # detokenizing) runs as it does in a server's API process, minus HTTP.
        timings = time_engine_outputs(llm)  # as the bundle's engine does (shared/obs/engine_outputs.py)
        meters = Meters(
            serving_cpu=time.process_time,
            process_cpu=server_cpu_by_role(os.getpid()),  # this process as "api", its engine core
            engine_output_wait=timings.wait.reading,
            engine_output_handling=timings.handling.reading,
        )
        return {
            "levels": await run_levels(scheduled(one, workload), workload, levels, rounds, repeat, meters),
            "max_num_batched_tokens": batch_token_budget(llm),
        }
    finally:
        stop_llm(llm)


async def bench_http(
    url: str,
    workload: Workload,
    levels: list[int],
    rounds: int,
    api_key: str | None = None,
    clients: int = 1,
    repeat: int = 1,
    meters: Meters = NO_METERS,
    request_ids: bool = False,
) -> list[dict]:
    """`request_ids`: every request carries its own X-Request-Id (identity's cost included)."""
    async with load_client(url) as client:
        one = http_requester(client, workload, api_key, request_ids=request_ids)
        await run_level(one, workload.prompts(WARM_UP_REQUESTS, "warm-up"), WARM_UP_REQUESTS)
        if clients <= 1:
            await open_connections(client, max(levels), api_key)  # as each client process does
            return await run_levels(scheduled(one, workload), workload, levels, rounds, repeat, meters)
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=clients, mp_context=spawn) as pool:

        async def in_processes(prompts: list[list[int]], level: int) -> dict[str, Any]:
            return run_level_in_processes(
                pool, url, workload, prompts, level, clients, api_key, request_ids=request_ids
            )

        return await run_levels(in_processes, workload, levels, rounds, repeat, meters)
