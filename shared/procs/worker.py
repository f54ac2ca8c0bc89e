"""One API process of several: the bundle's whole API (shared/http/api.py) on its own socket,
its engine a client of the shared engine core.

vLLM's `APIServerProcessManager` spawns it (shared/procs/vllm_launch.py) and calls
`run_api_process` with vLLM's client config, which names this process's index and its pair of
engine endpoints. It then runs exactly what one server process runs (shared/http/process.py:
the drain on SIGTERM, ENGINE_DEAD_EXIT_CODE when the engine dies), with three additions:
- `X-Bundle-Api-Process: <index>` on every response: which process served a request (tests
  address each process by it; operators can read it in a client's log);
- /metrics shows the whole server (shared/obs/process_metrics.py);
- BUNDLE_ENGINE_STATS_FILE gets the index in its name (`stats.json` -> `stats.1.json`), so
  that the processes do not overwrite each other's counts.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared.http.api import create_app
from shared.http.process import run_server
from shared.obs.process_metrics import ProcessBoard
from shared.procs.engine_client import ClientSlot, client_engine
from shared.procs.lineage import die_with_parent, end_now
from shared.server_state import ExitRequest
from shared.settings import Settings

PROCESS_HEADER = b"x-bundle-api-process"


@dataclass(frozen=True)
class WorkerSpec:
    """What every API process is handed (pickled by the spawn), whatever its index."""

    settings: Settings  # its identity store's URL filled in (supervisor.py)
    sockets: list[socket.socket]  # one per process, bound to the port (listeners.py); this one's by index
    core_pids: list[int]  # the engine core's processes, watched (engine_client.py)
    board: Path  # where the processes publish their metrics
    supervisor_pid: int


def run_api_process(_address: str, _sock: Any, spec: WorkerSpec, client_config: dict[str, Any]) -> None:
    """The process's entry, as vLLM's manager calls it (its address and socket are unused: each
    process has its own socket in `spec`). Exits with the code one server process would."""
    die_with_parent(spec.supervisor_pid)
    slot = ClientSlot.from_vllm(client_config)
    own = spec.sockets[slot.index]
    for other in spec.sockets:
        if other is not own:
            other.close()  # another process's share of the port
    _title(slot.index)
    settings = _settings_for(spec.settings, slot.index)
    logging.basicConfig(format="%(levelname)s:     %(processName)s %(name)s: %(message)s")
    logging.getLogger("shared").setLevel(settings.log_level.upper())
    board = ProcessBoard(spec.board, slot.index)

    def make_app(request_exit: ExitRequest) -> FastAPI:
        factory = partial(client_engine, slot=slot, core_pids=spec.core_pids)
        app = create_app(settings, engine_factory=factory, request_exit=request_exit)
        _publish_metrics(app, board)
        app.add_middleware(ProcessHeader, index=slot.index)
        return app

    code = run_server(settings, make_app, sockets=[own])
    end_now(code)


def _settings_for(settings: Settings, index: int) -> Settings:
    stats = settings.engine_stats_file
    if stats is None:
        return settings
    own = stats.with_name(f"{stats.stem}.{index}{stats.suffix}")
    return settings.model_copy(update={"engine_stats_file": own})


def _title(index: int) -> None:
    """`bundle::APIServer_<index>` in ps and /proc (vLLM titles its own API processes the same
    way, with its prefix): what the benchmark and the tests tell the processes apart by."""
    from vllm.utils.system_utils import set_process_title

    set_process_title("APIServer", str(index), prefix="bundle")


def _publish_metrics(app: FastAPI, board: ProcessBoard) -> None:
    """Once the app has started: share this process's metrics with the others, and read theirs."""
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(target: Any) -> AsyncIterator[Any]:
        async with inner(target) as state:
            registry = app.state.service.metrics.registry
            app.state.service.metrics.share_with(board)
            publisher = asyncio.create_task(board.publish_every(registry))
            try:
                yield state
            finally:
                publisher.cancel()
                board.publish(registry)  # the last figures, counted after this process is gone

    app.router.lifespan_context = lifespan


class ProcessHeader:
    """Pure ASGI middleware: names the serving API process on every response."""

    def __init__(self, app: ASGIApp, index: int) -> None:
        self.app = app
        self.header = (PROCESS_HEADER, str(index).encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), self.header]
            await send(message)

        await self.app(scope, receive, named)
