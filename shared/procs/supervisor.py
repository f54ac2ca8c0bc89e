"""`python -m shared.serve` with BUNDLE_API_PROCESSES=N > 1: N API processes, one engine core.

One API process runs the engine's client side (vLLM's output processing and detokenizing) and
every stream's SSE on one event loop, so on a fast GPU with a small model that one CPU core is
the ceiling. Here N processes each run the whole API on their own core, each with its
own `AsyncLLM` client of ONE engine core, as `vllm serve --api-server-count N` does
(vllm_launch.py). This process, the supervisor, serves nothing itself:

1. the identity store: BUNDLE_REDIS_URL, else a local valkey-server (local_store.py). The API
   processes are replicas to each other (docs/replicas.md): one generation per X-Request-Id,
   resume and cancel through any process, stored responses read by any;
2. the port: one SO_REUSEPORT socket per process (listeners.py);
3. the engine core and the API processes (vllm_launch.py, worker.py);
4. then it waits, and ends the server as one process would end:
   - SIGTERM or SIGINT: every API process gets SIGTERM and drains (shared/http/process.py); the
     engine core is stopped after the last has ended, so running streams keep their engine for
     the whole grace. The supervisor then ends as its API processes did (by the signal);
   - the engine core dies: each API process sees it (engine_client.py), tells its streams, and
     exits with ENGINE_DEAD_EXIT_CODE; so does the supervisor;
   - an API process ends on its own (a crash, the OOM killer): the others drain and stop, and
     the supervisor exits with that process's code, or API_PROCESS_LOST_EXIT_CODE when it had none;
   - every wait is bounded; what is left then is killed. Nothing outlives the supervisor: the
     local store last, then its directory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from multiprocessing import connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType

from pydantic import SecretStr

from shared.errors import SetupError
from shared.procs.listeners import bound_sockets, close_all
from shared.procs.local_store import LocalStore
from shared.procs.vllm_launch import Launched, launch
from shared.procs.worker import WorkerSpec, run_api_process
from shared.server_state import ENGINE_DEAD_EXIT_CODE, ENGINE_DEAD_LINGER_S, ERROR_FLUSH_BOUND_S
from shared.settings import Settings

log = logging.getLogger(__name__)

API_PROCESS_LOST_EXIT_CODE = 70  # EX_SOFTWARE (sysexits.h): part of the server failed on its own
# Beyond each API process's own bounds (its drain: uvicorn's graceful timeout, grace + 5 s; its
# exit after the engine died: error flush + linger), room for its shutdown on a busy machine.
MARGIN_S = 30.0
KILLED_WAIT_S = 10.0  # for processes killed at a deadline to be gone; then the supervisor moves on


def serve_processes(settings: Settings) -> int:
    """Serve until a signal or a death (module docstring); the exit status the process should
    end with, negative for "killed by that signal" as in `subprocess`."""
    _check(settings)
    workdir = Path(tempfile.mkdtemp(prefix="bundle-procs-"))
    store: LocalStore | None = None
    try:
        if settings.redis_url is None:
            store = LocalStore(workdir)  # first: its start forks, before any thread exists here
            store.start()
            # Takeover off: these processes share one fate (one ends, all end) and this store
            # dies with them, so no process could continue another's generation; with takeover
            # on, every event would wait for its write (docs/replicas.md) for nothing.
            settings = settings.model_copy(update={"redis_url": SecretStr(store.url), "takeover": False})
            log.info("request identity across the API processes: a local valkey-server (%s)", store.url)
        return _run(settings, workdir)
    finally:
        if store is not None:
            store.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def _check(settings: Settings) -> None:
    if settings.enable_lora and settings.lora_runtime_loading:
        # An adapter loaded through one process would be unknown to the others' catalogues (vLLM's
        # own server refuses runtime LoRA updates with --api-server-count > 1 too).
        raise SetupError(
            "BUNDLE_API_PROCESSES > 1 serves only the adapters loaded at start (BUNDLE_LORA_MODULES): "
            "set BUNDLE_LORA_RUNTIME_LOADING=false"
        )


def _run(settings: Settings, workdir: Path) -> int:
    board = workdir / "metrics"
    board.mkdir()
    sockets = bound_sockets(settings.host, settings.port, settings.api_processes)
    supervision = Supervision(settings)

    def spec(core_pids: list[int]) -> WorkerSpec:
        return WorkerSpec(settings, sockets, core_pids, board, os.getpid())

    try:
        with (
            supervision.signals_caught(),
            launch(settings, settings.api_processes, run_api_process, spec) as launched,
        ):
            close_all(sockets)  # each API process holds its own share of the port now
            return supervision.wait(launched)
    except Stopped as stop:  # a signal while the engine was still starting
        return -stop.signum
    finally:
        close_all(sockets)


class Stopped(BaseException):
    """A shutdown signal during start-up: abandon it (what started is stopped on the way out)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class Supervision:
    """The wait after start-up, and the signals that end it."""

    def __init__(self, settings: Settings) -> None:
        self.drain_bound_s = settings.shutdown_grace_s + 5 + MARGIN_S
        self.death_bound_s = ERROR_FLUSH_BOUND_S + ENGINE_DEAD_LINGER_S + MARGIN_S
        self.signalled: int | None = None
        self.started = False  # the engine is up and every API process was started
        self.running: list[BaseProcess] = []  # the API processes not yet ended
        self.killed: set[int] = set()  # pids killed at a deadline: their end is not "on their own"
        self.engine_ended = False
        self._deadline: float | None = None

    @contextlib.contextmanager
    def signals_caught(self) -> Iterator[None]:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        first = self.signalled is None
        self.signalled = self.signalled or signum
        if not self.started:
            if first:  # the engine is still starting: nothing serves yet. Once only: a second
                raise Stopped(signum)  # signal must not cut the clean-up the first one began
            return
        if first:
            log.info("signal %d: the %d API processes drain", signum, len(self.running))
            self._end_by(self.drain_bound_s)
        _terminate(self.running)

    def wait(self, launched: Launched) -> int:
        self.running = list(launched.api_processes)
        self.started = True
        if self.signalled is not None:  # arrived between the launch and now
            _terminate(self.running)
            self._end_by(self.drain_bound_s)
        codes: list[int] = []
        lost: int | None = None
        engines = {process.sentinel: process for process in launched.engine_processes}
        while self.running:
            ended = connection.wait([p.sentinel for p in self.running] + list(engines), self._left())
            if not ended and not self._past_deadline():
                break  # killed and still not gone: leave them to the managers' shutdown
            for sentinel in sorted(ended, key=lambda s: s not in engines):  # the engine's first
                if sentinel in engines:
                    engines.pop(sentinel)
                    self._on_engine_end()
                    continue
                process = next(p for p in self.running if p.sentinel == sentinel)
                self.running.remove(process)
                code = _exit_status(process)
                codes.append(code)
                if lost is None and self._lost(process, code):
                    lost = code
                    log.error("API process %s ended on its own (%d); stopping the others", process.name, code)
                    _terminate(self.running)
                    self._end_by(self.drain_bound_s)
        return self._verdict(codes, lost)

    def _past_deadline(self) -> bool:
        """Kill what is left at the first deadline (and wait a little for it to go); False once
        that wait is over too."""
        if self.killed:
            log.error("%d killed API processes are still there; moving on", len(self.running))
            return False
        log.error("%d API processes did not end in time; killing them", len(self.running))
        self.killed = {process.pid or 0 for process in self.running}
        _kill(self.running)
        self._deadline = time.monotonic() + KILLED_WAIT_S
        return True

    def _on_engine_end(self) -> None:
        self.engine_ended = True
        if self.signalled is None:  # else it is part of the shutdown (a signal to the whole group)
            log.error("the engine core exited; the API processes tell their streams and exit")
            self._end_by(self.death_bound_s)

    def _lost(self, process: BaseProcess, code: int) -> bool:
        """Whether an API process ended on its own: not drained after a signal, not killed here,
        and not for the engine's death (one whose own client failed while the core runs is lost)."""
        if self.signalled is not None or process.pid in self.killed:
            return False
        return not (code == ENGINE_DEAD_EXIT_CODE and self.engine_ended)

    def _verdict(self, codes: list[int], lost: int | None) -> int:
        """The supervisor's exit status: the engine's death (ENGINE_DEAD_EXIT_CODE) wins, then an
        API process lost (its own code, else API_PROCESS_LOST_EXIT_CODE), else (a shutdown) the
        status of the first API process to end, as one process would have ended."""
        if ENGINE_DEAD_EXIT_CODE in codes or (self.engine_ended and self.signalled is None):
            return ENGINE_DEAD_EXIT_CODE
        if lost is not None:
            return lost if lost > 0 else API_PROCESS_LOST_EXIT_CODE
        return codes[0] if codes else 0

    def _end_by(self, bound_s: float) -> None:
        deadline = time.monotonic() + bound_s
        self._deadline = deadline if self._deadline is None else min(self._deadline, deadline)

    def _left(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())


def _exit_status(process: BaseProcess) -> int:
    """Its status once its sentinel fired: the sentinel's pipe closes a moment before the
    process can be reaped, so it is joined (briefly) first."""
    process.join(KILLED_WAIT_S)
    return process.exitcode if process.exitcode is not None else -signal.SIGKILL


def _terminate(processes: list[BaseProcess]) -> None:
    for process in processes:
        with contextlib.suppress(ProcessLookupError, AttributeError):
            process.terminate()


def _kill(processes: list[BaseProcess]) -> None:
    for process in processes:
        with contextlib.suppress(ProcessLookupError, AttributeError):
            process.kill()
