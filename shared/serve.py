"""`python -m shared.serve`: run the API with uvicorn. Flags override BUNDLE_* settings.

On its way up the server prints one start-up marker per phase of its own to stderr,
`bundle-startup <phase> <unix time>`, which `bench/startup.py` reads beside vLLM's log lines:
`interpreter` (Python and the settings module loaded), `imports` (web stack and vLLM imported),
`settings` (settings read, model resolved: the tiny model and its tokenizer are built here on
first use), `engine` (vLLM's engine answered), `app` (the API's start-up finished).
"""

from __future__ import annotations

import argparse
import gc
import logging
import socket
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from shared.settings import Settings

if TYPE_CHECKING:
    from fastapi import FastAPI

    from shared.engine.vllm import VLLMEngine

MARKER = "bundle-startup"


def mark(phase: str) -> None:
    """One start-up marker line; flushed at once so a reader can time it as it arrives."""
    print(f"{MARKER} {phase} {time.time():.3f}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    mark("interpreter")
    parser = argparse.ArgumentParser(
        prog="python -m shared.serve",
        description="Serve the OpenAI-compatible API on vLLM. Every BUNDLE_* variable applies.",
    )
    parser.add_argument("--host", help="bind address (BUNDLE_HOST, default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (BUNDLE_PORT, default 8000)")
    parser.add_argument("--model", help="'tiny', a Hugging Face id or a path (BUNDLE_MODEL)")
    parser.add_argument(
        "--no-access-log",
        dest="access_log",
        action="store_false",
        default=None,
        help="no line per request (BUNDLE_ACCESS_LOG=false)",
    )
    args = parser.parse_args(argv)
    overrides = {key: value for key, value in vars(args).items() if value is not None}
    settings = Settings(**overrides)
    serve(settings)


def serve(settings: Settings) -> None:
    if settings.api_processes > 1:
        serve_processes(settings)
        return
    # The port first: a busy one is one line now, not after a start of minutes; and held from here
    # on, no other process (vLLM's own free-port picks during its start included) can take it.
    listener = claim_port(settings)
    from shared.cache.layout import point_caches_at
    from shared.engine.model_inspection import begin_inspection
    from shared.engine.vllm_startup import import_vllm, resolve_model_path
    from shared.http.api import create_app
    from shared.http.process import run_server
    from shared.server_state import ExitRequest

    # The bundle's own start-up lines (engine, request identity) next to uvicorn's.
    logging.basicConfig(format="%(levelname)s:     %(name)s: %(message)s")
    logging.getLogger("shared").setLevel(settings.log_level.upper())
    # vLLM's inspection of the model class runs in a process of its own beside the import
    # instead of after it (shared/engine/model_inspection.py); it reads the cache root from
    # the environment, so that is set first.
    point_caches_at(settings)
    begin_inspection(local_model_dir(settings))
    # vLLM would be imported by the app's start-up anyway; importing it here makes the import
    # cost one phase of its own in the start-up benchmark instead of hiding inside the engine's.
    import_vllm()
    mark("imports")
    resolve_model_path(settings)  # builds the tiny model on first use; cached afterwards
    mark("settings")

    def make_app(request_exit: ExitRequest) -> FastAPI:
        app = create_app(settings, engine_factory=marked_engine, request_exit=request_exit)
        _mark_when_started(app)
        return app

    # Non-zero only when the engine died: a supervisor must then replace this process.
    exit_code = run_server(settings, make_app, sockets=[listener])
    # The server, its engine and its threads have stopped. Python's last collection at exit would
    # walk the whole heap of vLLM and torch (8 s here, after a drain that had ended in 1.5 s);
    # frozen objects are left out of it, and the operating system frees them anyway.
    gc.freeze()
    if exit_code:
        raise SystemExit(exit_code)


def claim_port(settings: Settings) -> socket.socket:
    """BUNDLE_HOST:BUNDLE_PORT bound, not yet listening: connections are refused until the app
    has started, as when uvicorn binds. One it cannot bind: one line and exit 2."""
    from shared.errors import SetupError
    from shared.procs.listeners import bound_sockets

    try:
        return bound_sockets(settings.host, settings.port, 1)[0]  # forked children drop it: see there
    except SetupError as exc:
        print(f"python -m shared.serve: {exc.message}", file=sys.stderr)
        raise SystemExit(2) from None


def local_model_dir(settings: Settings) -> str:
    """The served model's folder as far as it is known before vLLM's import: the tiny model's
    is built after it (the first time), a Hugging Face id is resolved by the engine."""
    if settings.uses_tiny_model:
        from shared.models.tiny_model import model_dir

        return str(model_dir(settings.cache_dir, settings.tiny_model_shape, settings.tiny_model_seed))
    return settings.model


def serve_processes(settings: Settings) -> None:
    """BUNDLE_API_PROCESSES > 1: several API processes on one engine core (shared/procs/). A
    setup it cannot run is one line and exit 2; otherwise it ends as its API processes did."""
    from shared.errors import SetupError
    from shared.procs.lineage import end_now
    from shared.procs.supervisor import serve_processes as supervise

    logging.basicConfig(format="%(levelname)s:     %(name)s: %(message)s")
    logging.getLogger("shared").setLevel(settings.log_level.upper())
    try:
        code = supervise(settings)
    except SetupError as exc:
        print(f"python -m shared.serve: {exc.message}", file=sys.stderr)
        raise SystemExit(2) from None
    # As its API processes ended (by a signal: uvicorn re-raises the one that stopped it), at once:
    # every process it started is gone.
    end_now(code)


@asynccontextmanager
async def marked_engine(settings: Settings) -> AsyncIterator[VLLMEngine]:
    """`open_engine`, with a marker once the engine answers."""
    from shared.engine.vllm_startup import open_engine

    async with open_engine(settings) as engine:
        mark("engine")
        yield engine


def _mark_when_started(app: FastAPI) -> None:
    """Mark `app` once the app's own lifespan start-up (engine, service) has finished."""
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(target: Any) -> AsyncIterator[Any]:
        async with inner(target) as state:
            mark("app")
            yield state

    app.router.lifespan_context = lifespan


if __name__ == "__main__":
    main()
