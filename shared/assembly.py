"""The one way a running service is put together, whatever serves it (the HTTP app, the Cog
runner, Modal's container through the HTTP app):

    async with start_service(settings) as service:
        ...  # serve through `service` (shared/service.py), the one door

It opens the engine (or takes the one a caller started, as Modal's snapshot hooks do), warms it
up unless BUNDLE_WARM_UP=0 or it was warmed already (before a snapshot), guards it against death
and shutdown (shared/server_state.py), sets the garbage collector's serving thresholds, and runs
the engine-death watchdog, the loop-lag watcher and the GC pause timer for the service's lifetime.
Leaving aborts what still runs and stops the engine it opened.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

from shared.engine.contract import Engine
from shared.engine.vllm import open_engine
from shared.gc_thresholds import gc_thresholds
from shared.lifecycle import warm_up_once
from shared.server_state import GuardedEngine, ServerState
from shared.service import Service
from shared.settings import Settings

log = logging.getLogger(__name__)

EngineFactory = Callable[[Settings], AbstractAsyncContextManager[Engine]]


@asynccontextmanager
async def start_service(
    settings: Settings,
    *,
    engine: Engine | None = None,
    engine_factory: EngineFactory = open_engine,
    server_state: ServerState | None = None,
) -> AsyncIterator[Service]:
    """The service for the block's lifetime. With `engine`, the caller owns its life (and its
    warm-up: tests share one engine between many services); otherwise `engine_factory` opens one
    here, warmed before the service is handed out, so nothing is served before that."""
    server_state = server_state or ServerState(settings.shutdown_grace_s)
    async with contextlib.AsyncExitStack() as stack:
        if engine is None:
            engine = await stack.enter_async_context(engine_factory(settings))
            await _warm(engine, settings)
        service = Service(settings, GuardedEngine(engine, server_state))
        stack.push_async_callback(service.aclose)  # last in, so it runs before the engine stops
        with gc_thresholds(settings.gc_thresholds):
            async with _watched(service, server_state):
                yield service


async def _warm(engine: Engine, settings: Settings) -> None:
    if not settings.warm_up:
        log.info("warm-up skipped (BUNDLE_WARM_UP=0): the first requests pay for first-use compiles")
        return
    await warm_up_once(engine, settings)


@asynccontextmanager
async def _watched(service: Service, server_state: ServerState) -> AsyncIterator[None]:
    """The engine-death watchdog, the loop-lag watcher and the GC pause timer, for as long as
    the block runs."""
    watchers = [
        asyncio.create_task(server_state.watch(service)),
        asyncio.create_task(service.watch_loop_lag()),
    ]
    try:
        with service.gc_pauses_observed():
            yield
    finally:
        for task in watchers:
            task.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
        server_state.close()
