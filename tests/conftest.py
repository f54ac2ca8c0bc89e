"""Shared fixtures: ONE real vLLM engine (CPU build, tiny model) for the whole session.

The engine lives on an event loop in a background thread. Each test that needs different API
settings (an API key, a small in-flight cap, a short grace window) gets its own app and uvicorn
server on that same loop, all sharing the one engine, so the suite starts vLLM once.

The engine is wrapped in the test gate (tests/gate.py): a test that needs a generation still
running takes the `gate` fixture and holds it; every other generation passes untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import tempfile
import threading
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
import pytest
import uvicorn

from shared.engine.contract import Engine
from shared.engine.vllm_startup import open_engine
from shared.http.api import create_app
from shared.service import Service
from shared.settings import Settings
from tests.gate import Gate, GatedEngine
from tests.redis_server import redis_server  # noqa: F401  (fixture: a real Redis-protocol server)

if TYPE_CHECKING:
    from tests.real_server import RealStart

T = TypeVar("T")

# Enough room for the tests' long generations; eager mode starts in ~20 s instead of ~50 s.
ENGINE_SETTINGS = Settings(max_num_seqs=64, max_model_len=2048, enforce_eager=True)
IPC_DIR_KEY = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    """vLLM names its ZMQ sockets `ipc://<VLLM_RPC_BASE_PATH>/<uuid>` (default: the temp folder)
    and leaves them behind when an engine stops: ~23 per run of this suite. They go into a folder
    of this run's, removed at its end, with every engine and server the tests start (inherited)."""
    if "VLLM_RPC_BASE_PATH" in os.environ:
        return
    folder = tempfile.mkdtemp(prefix="bundle-tests-ipc-")
    os.environ["VLLM_RPC_BASE_PATH"] = folder
    config.stash[IPC_DIR_KEY] = folder


def pytest_unconfigure(config: pytest.Config) -> None:
    if folder := config.stash.get(IPC_DIR_KEY, None):
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop("VLLM_RPC_BASE_PATH", None)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LiveServers:
    """Runs apps on one event loop thread, all backed by one engine."""

    def __init__(
        self,
        engine_factory: Callable[[Settings], Any] = open_engine,
        engine_settings: Settings = ENGINE_SETTINGS,
    ) -> None:
        self.engine_settings = engine_settings
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self._stack = contextlib.AsyncExitStack()
        self.gate_dir = Path(tempfile.mkdtemp(prefix="bundle-gate-"))
        engine = self.call(self._stack.enter_async_context(engine_factory(engine_settings)))
        self.engine: Engine = GatedEngine(engine, self.gate_dir)
        self._servers: list[uvicorn.Server] = []
        self._serving: list[asyncio.Task[None]] = []

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 300) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def serve(self, **overrides: Any) -> tuple[str, Service]:
        """Start an app with these settings; return its base URL and its Service."""
        return self.serve_with({}, **overrides)

    def serve_with(self, uvicorn_options: dict[str, Any], **overrides: Any) -> tuple[str, Service]:
        """`serve`, with these uvicorn.Config options (the bundle's protocol, say)."""
        settings = Settings(**{**self.engine_settings.model_dump(), **overrides})
        app = create_app(settings, engine=self.engine)
        port = free_port()
        config = uvicorn.Config(
            app, host="127.0.0.1", port=port, log_level="warning", lifespan="on", **uvicorn_options
        )
        server = uvicorn.Server(config)
        self._servers.append(server)

        async def start() -> None:
            self._serving.append(self.loop.create_task(server.serve()))
            while not server.started:
                await asyncio.sleep(0.01)

        self.call(start())
        return f"http://127.0.0.1:{port}", app.state.service

    @contextlib.contextmanager
    def engine_paused(self) -> Iterator[None]:
        """vLLM's scheduler paused for the block (mode "keep"): requests sent meanwhile wait in its
        queue and all start in the first step after it; resumed however the block ends."""
        llm = self.engine.llm  # type: ignore[attr-defined]
        self.call(llm.pause_generation(mode="keep", clear_cache=False))
        try:
            yield
        finally:
            self.call(llm.resume_generation())

    def close(self) -> None:
        async def stop() -> None:
            for server in self._servers:
                server.should_exit = True
            # Each app's shutdown (its service, its store clients) ends before the engine stops
            # and the loop with it: a fixed pause left some mid-way on a busy machine.
            if self._serving:
                await asyncio.wait(self._serving, timeout=60)
            await self._stack.aclose()

        with contextlib.suppress(Exception):
            self.call(stop(), timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        shutil.rmtree(self.gate_dir, ignore_errors=True)


# Set by the Makefile's Python 3.12 run of the HTTP layer, which installs no engine: the tests
# that need the real one skip there (and only there: without it, a missing vLLM is an error).
WITHOUT_ENGINE = "BUNDLE_TESTS_WITHOUT_ENGINE"


@pytest.fixture(scope="session")
def live() -> Iterator[LiveServers]:
    if os.environ.get(WITHOUT_ENGINE):
        pytest.skip("this run installs no engine (the Makefile's Python 3.12 run)")
    servers = LiveServers()
    yield servers
    servers.close()


@pytest.fixture(scope="session")
def default_server(live: LiveServers) -> tuple[str, Service]:
    return live.serve()


@pytest.fixture(scope="session")
def real_start(tmp_path_factory: pytest.TempPathFactory) -> RealStart:
    """One real `python -m shared.serve` start through the start-up benchmark, stopped by SIGTERM
    to its group with a stream running: the start-up test reads the benchmark's report, the
    shutdown test what the stream and the process did (tests/real_server.py, RealStart)."""
    from tests.real_server import start_through_the_benchmark  # it imports this module

    return start_through_the_benchmark(tmp_path_factory.mktemp("real-start"))


@pytest.fixture
def gate(live: LiveServers) -> Iterator[Gate]:
    """Holds generations of the session's engine (tests/gate.py); whatever the test left held
    is released when it ends, passed or failed."""
    gate = Gate(live.gate_dir)
    yield gate
    gate.release_all()


@pytest.fixture
def base_url(default_server: tuple[str, Service]) -> str:
    return default_server[0]


@pytest.fixture
def service(default_server: tuple[str, Service]) -> Service:
    return default_server[1]


@pytest.fixture
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=60) as client:
        yield client


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.02) -> float:
    """Poll until predicate() holds; return the seconds it took, or fail."""
    import time

    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout} s")


def long_chat(**extra: Any) -> dict[str, Any]:
    """A chat request that keeps the engine busy for a while (fixed length via ignore_eos)."""
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "tell me a long story"}],
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
        **extra,
    }
