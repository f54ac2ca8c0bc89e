"""The engine as one of several API processes sees it: an `AsyncLLM` that joins an engine core
started by the supervisor (shared/procs/vllm_launch.py), and a watch on that core's life.

vLLM's `AsyncLLM` watches an engine core it started itself (its MPClientEngineMonitor thread):
when the core dies it marks itself dead and shuts its client down, which ends every running
request with EngineDeadError. A client of a core started elsewhere has no such watch; vLLM's own
`--api-server-count` mode relies on its supervisor to end all its API processes instead. Here
each API process watches the core itself (a pidfd on its pid, readable the moment it exits) and
does what vLLM's monitor does, so a dead engine looks to each process exactly as it does to a
single one: /health 503, an error event on every running stream, then exit with
ENGINE_DEAD_EXIT_CODE (shared/server_state.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

from shared.engine.vllm import VLLMEngine
from shared.engine.vllm_startup import engine_args, freeze_startup_heap, import_engine_modules, open_engine
from shared.settings import Settings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClientSlot:
    """This API process's place among the engine core's clients, from vLLM's client config."""

    index: int
    count: int
    addresses: dict[str, Any]  # what `AsyncLLM` takes as `client_addresses`

    @classmethod
    def from_vllm(cls, client_config: dict[str, Any]) -> ClientSlot:
        config = dict(client_config)
        index, count = int(config.pop("client_index")), int(config.pop("client_count"))
        # vLLM's API processes share this table to accept on the least loaded one; the bundle's
        # have a socket each (listeners.py), so nothing reads it.
        config.pop("api_server_loads", None)
        return cls(index, count, config)


def start_client_llm(settings: Settings, slot: ClientSlot) -> Any:
    """An `AsyncLLM` on the shared engine core, configured as `vllm serve` configures each of
    its API processes (`--api-server-count`): the same engine arguments, its own rank."""
    import_engine_modules()
    from vllm.platforms import current_platform
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    args = engine_args(settings, on_cpu=current_platform.is_cpu())
    args._api_process_count = slot.count
    args._api_process_rank = slot.index
    config = args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    llm = AsyncLLM.from_vllm_config(
        config,
        usage_context=UsageContext.OPENAI_API_SERVER,
        disable_log_stats=True,  # as the bundle's own engine (shared/engine/vllm_startup.py)
        client_addresses=slot.addresses,
        client_count=slot.count,
        client_index=slot.index,
    )
    freeze_startup_heap()
    return llm


@contextlib.asynccontextmanager
async def client_engine(
    settings: Settings, slot: ClientSlot, core_pids: list[int]
) -> AsyncIterator[VLLMEngine]:
    """`open_engine` on the shared core, watched for as long as it is open."""
    async with open_engine(settings, start=partial(start_client_llm, slot=slot)) as engine:
        with engine_core_watched(engine.llm, core_pids):
            yield engine


@contextlib.contextmanager
def engine_core_watched(llm: Any, pids: list[int]) -> Iterator[None]:
    """Mark `llm` dead as soon as one of the engine core's processes exits (module docstring)."""
    loop = asyncio.get_running_loop()
    watched: list[int] = []

    def exited(pid: int) -> None:
        for fd in watched:
            loop.remove_reader(fd)
        if not llm.errored:
            log.error("the engine core (pid %d) exited: this API process ends what it runs", pid)
        llm.engine_core.shutdown()  # as vLLM's own monitor: engine_dead, then the client's clean-up

    try:
        for pid in pids:
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:  # gone before this process came up
                exited(pid)
                continue
            watched.append(fd)
            loop.add_reader(fd, exited, pid)
        yield
    finally:
        for fd in watched:
            loop.remove_reader(fd)
            os.close(fd)
