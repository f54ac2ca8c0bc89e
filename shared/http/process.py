"""One server process: uvicorn with the bundle's bounds, a bounded drain, and an honest exit code.
It checks uvicorn's and Starlette's internals at start (shared/http/server_internals.py).

- SIGTERM/SIGINT: uvicorn closes the listening socket at once (new connections are refused) and
  waits for open responses; the app's `ServerState` starts its grace timer at the same moment, so
  streams still running at `shutdown_grace_s` end with a "server shutting down" error event
  instead of being cut by the platform's kill. Once the drain and the engine's stop are over the
  process exits 0: the drain it was asked for is done. (uvicorn would raise the signal again at
  its end instead, and the process would die of it rather than say how it ended.)
- A dead engine: the app asks this server to exit (after in-flight streams got their error
  events), and the process exits with `ENGINE_DEAD_EXIT_CODE` so a supervisor replaces it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable, Iterator
from types import FrameType

import uvicorn
from fastapi import FastAPI

from shared.http import server_internals
from shared.http.limits import uvicorn_options
from shared.server_state import ExitRequest
from shared.settings import Settings


def run_server(
    settings: Settings,
    make_app: Callable[[ExitRequest], FastAPI] | None = None,
    sockets: list[socket.socket] | None = None,
) -> int:
    """Serve the API until a signal or engine death; return the exit code the process should use.
    `make_app(request_exit)` builds the app (default: `create_app(settings, request_exit=...)`).
    `sockets`: serve on these, bound by the caller (shared/procs/listeners.py), instead of
    binding BUNDLE_HOST:BUNDLE_PORT."""
    from shared.http.api import create_app

    exit_code = 0

    def request_exit(code: int) -> None:
        nonlocal exit_code
        exit_code = code
        server.should_exit = True

    def on_signal() -> None:
        service = getattr(app.state, "service", None)
        if service is not None:  # None: still starting, nothing to drain
            app.state.server_state.begin_shutdown(service)

    # Checked before anything is built on them: the protocols below and every stream's direct
    # write follow what it found. One line, and the app's /metrics (`bundle_server_features`).
    internals = server_internals.found()
    server_internals.log_found(internals)
    app = make_app(request_exit) if make_app else create_app(settings, request_exit=request_exit)
    app.state.server_internals = internals
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=settings.access_log,
        **uvicorn_options(settings, internals),
    )
    server = DrainingServer(config, on_signal)
    if sockets is None:
        server.run()  # binds BUNDLE_HOST:BUNDLE_PORT itself, as ever
    else:
        server.run(sockets=sockets)
    return exit_code


class DrainingServer(uvicorn.Server):
    """uvicorn's server that also tells the app when a shutdown signal arrives, and ends a drain
    with an exit code instead of the signal (module docstring)."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_signal = on_signal

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        # A signal handler runs between two bytecodes of the loop's own thread: schedule the
        # drain on the loop rather than touch its state from here.
        with contextlib.suppress(RuntimeError):  # no loop running (yet or any more): nothing to drain
            asyncio.get_running_loop().call_soon(self._on_signal)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            # uvicorn raises each signal it captured again as this block ends, now with the
            # default handler: the signal it took for a drain would kill the process at its end.
            server_internals.forget_captured_signals(self)
