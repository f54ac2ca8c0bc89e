"""The server's life after start-up: serving, draining after SIGTERM, or dead with its engine.

- Engine death: admission answers 503 at once (never a 200 that then carries an error), the
  engine gauges read 0, and once the in-flight streams have received their error events the
  process is asked to exit with `ENGINE_DEAD_EXIT_CODE`, so a supervisor (Modal, Cog, systemd,
  Kubernetes) replaces it instead of keeping a process that can only refuse.
- Shutdown: after SIGTERM the running streams get `shutdown_grace_s` to finish, then end with a
  `ShuttingDown` error event (send it again under a new X-Request-Id: the old one replays this
  end), distinct from engine death. The listener closes at once (shared/http/process.py); a
  request that got in before that gets 503 (retry with the same id: nothing ran).
  When the whole process group is signalled, vLLM's engine core stops at the same moment; the
  engine's failure then is part of the shutdown, and clients are told so, not that it "died".

The service reaches the engine through `GuardedEngine`, which applies both to generations and
to the engine's count of running requests.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from shared.engine.contract import Engine, EngineDelta, SamplingRequest
from shared.engine.wrapper import EngineWrapper
from shared.errors import SHUT_DOWN_MID_GENERATION, SHUTDOWN_MESSAGE, EngineUnavailable, ShuttingDown

if TYPE_CHECKING:
    from shared.service import Service

log = logging.getLogger(__name__)

ENGINE_DEAD_EXIT_CODE = 69  # EX_UNAVAILABLE (sysexits.h): the service this process offers is gone
WATCH_INTERVAL_S = 0.25  # how often the watchdog reads the engine's (lock-free) health flag
# A SIGTERM sent to the whole group reaches the API process and the engine core together; the
# engine's failure can surface first. This pause lets the API's own signal handler run before a
# failing generation decides whether it is reporting a death or a shutdown.
SIGNAL_SETTLE_S = 0.2
# Upper bound on waiting for in-flight streams to receive their error events before exiting.
ERROR_FLUSH_BOUND_S = 5.0
# Then the server stays up this long answering 503, so health probes and load balancers see a
# clear refusal (and route away) before the port closes and clients see connection errors.
ENGINE_DEAD_LINGER_S = 2.0

ExitRequest = Callable[[int], None]


class ServerState:
    SERVING, DRAINING, ENGINE_DEAD = "serving", "draining", "engine_dead"

    def __init__(self, shutdown_grace_s: float, request_exit: ExitRequest | None = None) -> None:
        self.state = self.SERVING
        self.shutdown_grace_s = shutdown_grace_s
        self.request_exit = request_exit  # None: nobody to tell (tests, Modal); just refuse
        self._grace_timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    def check_admission(self) -> None:
        """Refuse a new generation unless serving: 503 before any byte of a 200 is sent."""
        if self.state == self.DRAINING:
            raise ShuttingDown(SHUTDOWN_MESSAGE)
        if self.state == self.ENGINE_DEAD:
            raise EngineUnavailable("the engine is not running; this server is exiting")

    # --- shutdown -------------------------------------------------------------------------------
    def begin_shutdown(self, service: Service) -> None:
        """SIGTERM arrived: refuse new work; end what still runs when the grace is over."""
        if self.state != self.SERVING:
            return
        self.state = self.DRAINING
        log.info("draining: running streams get %.1f s before they are ended", self.shutdown_grace_s)
        loop = asyncio.get_running_loop()
        self._grace_timer = loop.call_later(self.shutdown_grace_s, self._end_running, service)

    def _end_running(self, service: Service) -> None:
        # Aborted with reason "shutdown", which readers see as ShuttingDown.
        self._spawn(service.end_running())

    # --- engine death -------------------------------------------------------------------------
    async def watch(self, service: Service) -> None:
        """Runs for the app's lifetime: notice a dead engine, then exit once streams are told."""
        # Polled: vLLM flips its dead flag from a monitor thread and offers nothing to await.
        while service.healthy() or self.state == self.DRAINING:  # noqa: ASYNC110
            await asyncio.sleep(WATCH_INTERVAL_S)
        await asyncio.sleep(SIGNAL_SETTLE_S)
        if self.state == self.DRAINING:
            return  # the engine stopped with the rest of the group; the drain ends the process
        self.state = self.ENGINE_DEAD
        service.metrics.engine_deaths.inc()
        log.error("the engine died; refusing new requests and exiting once in-flight streams ended")
        await _streams_ended(service, ERROR_FLUSH_BOUND_S)
        await asyncio.sleep(ENGINE_DEAD_LINGER_S)
        if self.request_exit is not None:
            self.request_exit(ENGINE_DEAD_EXIT_CODE)

    def close(self) -> None:
        if self._grace_timer is not None:
            self._grace_timer.cancel()
        for task in self._tasks:
            task.cancel()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


async def _streams_ended(service: Service, bound_s: float) -> None:
    """Wait (bounded) until no generation runs and no client is still reading a stream."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound_s
    while loop.time() < deadline:
        running = service.stats()["running_generations"]
        readers = service.metrics.streams_read
        if running == 0 and readers == 0:
            return
        await asyncio.sleep(0.05)


class GuardedEngine(EngineWrapper):
    """The engine as the service sees it: a failure while the server drains is reported as the
    shutdown it is, and a dead engine counts no running requests (its own count is frozen).
    Every other member of `Engine` is passed on (`EngineWrapper`)."""

    def __init__(self, engine: Engine, server_state: ServerState) -> None:
        super().__init__(engine)
        self._server_state = server_state

    async def generate(self, request_id: str, request: SamplingRequest) -> AsyncIterator[EngineDelta]:
        try:
            async for delta in self.inner.generate(request_id, request):
                yield delta
        except EngineUnavailable as exc:
            await asyncio.sleep(SIGNAL_SETTLE_S)
            if self._server_state.state == ServerState.DRAINING:
                raise ShuttingDown(SHUT_DOWN_MID_GENERATION) from exc
            raise

    def running_requests(self) -> int:
        return self.inner.running_requests() if self.inner.healthy() else 0
