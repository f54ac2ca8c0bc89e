"""The port, split over the API processes: one socket each, bound by the supervisor with
SO_REUSEPORT, so the kernel spreads new connections over the processes (by a hash of each
connection's addresses) and every process accepts only its own share.

One listening socket shared by all (vLLM's `--api-server-count` hands the same socket to each
process) leaves the spread to whichever process wakes first: asyncio's and libuv's accept loops
take every pending connection at once, so a burst of new streams lands on one process (vLLM 0.32
added a shared load table to counter that). Per-process sockets need no such table.

The sockets are bound here but not listening: uvicorn listens on its socket once its process has
started (engine client, warm-up), so until then connections go to the processes that are
serving, and with none serving they are refused, as with one process. The port is held from the
bind on, so `--port 0` resolves once, here, for all of them. A single process binds its port here
too (shared/serve.py), without SO_REUSEPORT.
"""

from __future__ import annotations

import contextlib
import os
import socket
from functools import partial

from shared.errors import SetupError


def bound_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` sockets bound to one (host, port); port 0 picks one for all. SO_REUSEPORT only
    when there are several: a lone server's port stays its own, and a second server started on
    it is refused instead of silently taking half its connections."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if count > 1:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
            port = sock.getsockname()[1]  # the one port 0 chose, for the others
    except OSError as exc:
        close_all(sockets)
        raise SetupError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    except BaseException:
        close_all(sockets)
        raise
    # On CUDA vLLM forks its engine core (the CPU build spawns it), after the port is bound. A
    # forked child's copies would keep the port listening once the API processes closed theirs for
    # a drain: connections made then would queue unanswered instead of being refused. So forked
    # children drop their copies (the API processes are spawned and handed theirs on purpose).
    os.register_at_fork(after_in_child=partial(close_all, sockets))
    return sockets


def close_all(sockets: list[socket.socket]) -> None:
    for sock in sockets:
        with contextlib.suppress(OSError):
            sock.close()
