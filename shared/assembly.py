"""The one way a running service is put together, whatever serves it (the HTTP app, the Cog
runner, Modal's container through the HTTP app):

    async with start_service(settings) as service:
        ...  # serve through `service` (shared/service.py), the one door

It opens the engine (or takes the one a caller started, as Modal's snapshot hooks do), warms it
up unless BUNDLE_WARM_UP=0 or it was warmed already (before a snapshot), guards it against death
and shutdown (shared/server_state.py), sets the garbage collector's serving thresholds, and runs
the engine-death watchdog, the loop-lag watcher and the GC pause timer for the service's lifetime,
and the OTLP export when one is configured (shared/obs/otlp.py).
Leaving aborts what still runs and stops the engine it opened.

Before it, a server whose weights come from a URL (the Cog runner) calls `prepare_start`: the
weights, a compile-cache pack and vLLM's import, side by side instead of one after the other.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from shared.cache.layout import point_caches_at
from shared.cache.start import fetch_pack
from shared.engine.contract import Engine, EngineFactory
from shared.engine.model_inspection import begin_inspection
from shared.engine.vllm_startup import import_engine_modules, open_engine, resolve_model_path
from shared.gc_thresholds import gc_thresholds
from shared.lifecycle import warm_up_once
from shared.models.weights import bundled_pack, resolve_weights
from shared.obs.gc_pauses import gc_pauses_observed
from shared.obs.gpu_memory import watch_gpu_memory
from shared.obs.loop_lag import watch_loop_lag
from shared.obs.otlp import Telemetry, start_telemetry
from shared.server_state import GuardedEngine, ServerState
from shared.service import Service
from shared.settings import Settings

log = logging.getLogger(__name__)

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
        telemetry = _telemetry(service, settings)
        if telemetry is not None:  # flushed after the service's own shutdown counted its aborts
            stack.push_async_callback(telemetry.aclose)
        stack.push_async_callback(service.aclose)  # last in, so it runs before the engine stops
        with gc_thresholds(settings.gc_thresholds):
            async with _watched(service, server_state):
                yield service


def _telemetry(service: Service, settings: Settings) -> Telemetry | None:
    """The gauges only the assembly knows (the objective, GPU memory), and the OTLP export when
    OTEL_EXPORTER_OTLP_ENDPOINT is set (shared/obs/otlp.py; None, and nothing imported, else)."""
    service.metrics.ttft_sla.set(settings.ttft_sla_s)
    watch_gpu_memory(service.metrics.registry)
    loop = asyncio.get_running_loop()
    telemetry = start_telemetry(settings, lambda: service.metrics.server_families(settings.api_processes), loop)
    service.telemetry = telemetry
    return telemetry


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
        asyncio.create_task(watch_loop_lag(service.metrics.event_loop_lag)),
    ]
    try:
        with gc_pauses_observed(service.metrics.gc_pause):
            yield
    finally:
        for task in watchers:
            task.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
        server_state.close()


async def prepare_start(settings: Settings, weights: str | None = None) -> Settings:
    """What the engine start waits for, side by side: the weights `weights` names (a URL:
    downloaded and unpacked; else served as it is), the compile-cache pack BUNDLE_COMPILE_CACHE
    names (a URL: downloaded), and vLLM's import (~18 s on the H200), which needs neither.
    The settings returned serve those weights and name the pack as a local file or folder: the
    one BUNDLE_COMPILE_CACHE names, else a `cache/` folder that came inside the weights' tar.
    The engine start unpacks it where it matches (shared/cache/start.py). A weights failure
    fails the start, as it always did; a pack that cannot be had is one log line."""
    point_caches_at(settings)  # before the import, which the variables may concern
    started = time.monotonic()
    resolved, pack, import_s = await asyncio.gather(
        asyncio.to_thread(with_weights_inspected, settings, weights),
        asyncio.to_thread(fetch_pack, settings),
        asyncio.to_thread(_timed, import_engine_modules),
    )
    log.info(
        "start prepared in %.1f s (vLLM imported in %.1f s while the weights and the pack were fetched)",
        time.monotonic() - started,
        import_s,
    )
    return resolved.model_copy(update={"compile_cache": _pack_to_use(settings, pack, weights)})


def with_weights_inspected(settings: Settings, weights: str | None) -> Settings:
    """The weights, then vLLM's inspection of their model class begun beside the import (an
    empty container's start waited 17-19 s for it on the H200: shared/engine/model_inspection.py)."""
    resolved = with_weights(settings, weights)
    begin_inspection(resolve_model_path(resolved))
    return resolved


def with_weights(settings: Settings, weights: str | None) -> Settings:
    if not weights:
        return settings
    return settings.model_copy(update={"model": resolve_weights(weights, settings.cache_dir)})


def _pack_to_use(settings: Settings, fetched: Path | None, weights: str | None) -> str | None:
    bundled = bundled_pack(weights, settings.cache_dir) if weights else None
    if settings.compile_cache is not None:
        if bundled is not None:
            log.info(
                "compile-cache pack: BUNDLE_COMPILE_CACHE is set, so the weights' %s/ folder is not used",
                bundled.name,
            )
        return str(fetched) if fetched is not None else None
    return str(bundled) if bundled is not None else None


def _timed(work: Callable[[], None]) -> float:
    started = time.monotonic()
    work()
    return time.monotonic() - started
