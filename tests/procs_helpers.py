"""For tests of several API processes behind one port (tests/test_api_processes.py): reaching
each process on purpose, holding the engine's output, and the processes a server leaves behind.

Holding the output: the API processes are other processes, so no hook in the test's own code can
hold their engine. The engine core itself is held instead: SIGSTOP stops its scheduler, so no
step runs and no token is made, whatever the machine's speed, until SIGCONT. The API processes
are untouched (they still admit, attach, resume and cancel), and a request sent meanwhile waits
in the core's queue. (tests/gate.py, being built on another branch, holds an in-process engine;
this is the out-of-process counterpart.)
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

import httpx
import psutil

from shared.procs.worker import PROCESS_HEADER

HEADER = PROCESS_HEADER.decode()
PIN_ATTEMPTS = 64  # new connections tried per process: the kernel spreads them by a hash


class PinnedClients:
    """Keep-alive connections pinned to each API process. SO_REUSEPORT sends each NEW connection
    to one of the processes (shared/procs/listeners.py); a kept connection stays with it. A
    client is (re)connected until the process it should reach answers, and the tests check every
    response's process. `line` tells apart several connections to one process (one busy with a
    stream, another reading /metrics meanwhile)."""

    def __init__(self, url: str, count: int) -> None:
        self.url = url
        self._clients: dict[tuple[int, str], httpx.Client] = {}
        for index in range(count):
            self.client(index)

    def client(self, index: int, line: str = "main") -> httpx.Client:
        """A client whose one connection is to process `index` now (a GET /health proves it)."""
        current = self._clients.get((index, line))
        if current is not None and self._answers(current) == index:
            return current
        if current is not None:
            current.close()
        for _ in range(PIN_ATTEMPTS):
            candidate = httpx.Client(base_url=self.url, timeout=120, limits=httpx.Limits(max_connections=1))
            if self._answers(candidate) == index:
                self._clients[(index, line)] = candidate
                return candidate
            candidate.close()
        raise AssertionError(f"no connection reached API process {index} in {PIN_ATTEMPTS} tries")

    @staticmethod
    def _answers(client: httpx.Client) -> int:
        return served_by(client.get("/health"))

    def close(self) -> None:
        for client in self._clients.values():
            client.close()


def served_by(response: httpx.Response) -> int:
    return int(response.headers[HEADER])


class EngineHold:
    """Holds the engine core's output between `stop()` and `release()` (module docstring); a
    `with` block always releases."""

    def __init__(self, core: psutil.Process) -> None:
        self.core = core

    def stop(self) -> None:
        self.core.send_signal(signal.SIGSTOP)

    def release(self) -> None:
        with contextlib.suppress(psutil.NoSuchProcess):
            self.core.send_signal(signal.SIGCONT)

    def __enter__(self) -> EngineHold:
        return self

    def __exit__(self, *_: object) -> None:
        self.release()


class StreamReader:
    """Reads one streaming response in steps: whole events first, the rest later."""

    def __init__(self, response: httpx.Response) -> None:
        self._pieces = response.iter_raw()
        self.raw = b""

    def events(self, count: int) -> bytes:
        """At least `count` whole events read; returns the whole events read so far."""
        while self.raw.count(b"\n\n") < count:
            self.raw += next(self._pieces)
        return self.raw[: self.raw.rindex(b"\n\n") + 2]

    def rest(self) -> bytes:
        for piece in self._pieces:
            self.raw += piece
        return self.raw


def process_tree(pid: int) -> list[psutil.Process]:
    """The process and everything it started, at this moment."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def left_running(processes: list[psutil.Process], timeout: float) -> list[str]:
    """Of `processes`, those still alive after `timeout` seconds (zombies count as ended)."""
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    left = []
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            if process.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{process.pid} {' '.join(process.cmdline())}")
    return left


@contextlib.contextmanager
def closing(clients: PinnedClients) -> Iterator[PinnedClients]:
    try:
        yield clients
    finally:
        clients.close()
