"""The real Cog server (coglet 0.23.1) for tests: launch, stop, read predictions over SSE and
webhooks, and steer tests/cog_hold_runner.py's holds.

`python -m cog.server.http` from the repository root, its own process group (killed at the
end), with the runner given as COG_PREDICT_TYPE_STUB: cog/predict.py:Runner, or the same runner
with holds (HOLD_RUNNER_REF) whose files live in `CogServer.holds.folder`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from aiohttp import web

from .conftest import free_port
from .gate import Gate

ROOT = Path(__file__).resolve().parent.parent
RUNNER_REF = "cog/predict.py:Runner"
HOLD_RUNNER_REF = "tests/cog_hold_runner.py:Runner"
HOLD_DIR_VARIABLE = "COG_TEST_HOLD_DIR"  # = tests/cog_hold_runner.py's
GATE_FOLDER = "gate"  # = tests/cog_hold_runner.py's
RELEASED = 1_000_000  # a budget no generation reaches: everything passes


class Holds:
    """The hold files of tests/cog_hold_runner.py (its docstring says what each one does)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        (folder / GATE_FOLDER).mkdir()
        # Holds by a word in the prompt, the engine frozen if asked (tests/gate.py).
        self.gate = Gate(folder / GATE_FOLDER)

    def budget(self, prediction: str, outputs: int) -> None:
        self._write(prediction, "budget", str(outputs))

    def release(self, prediction: str) -> None:
        self.budget(prediction, RELEASED)

    def hold(self, prediction: str, point: str) -> None:
        self._write(prediction, "hold", point)

    def marker(self, prediction: str, name: str) -> str | None:
        """The runner's marker's text (its first line), or None while it has not written it."""
        try:
            return (self.folder / f"{prediction}.{name}").read_text().split("\n")[0]
        except FileNotFoundError:
            return None

    def marked_at(self, prediction: str, name: str) -> float:
        """When the runner wrote the marker (its time.time())."""
        return float((self.folder / f"{prediction}.{name}").read_text().split("\n")[1])

    def wait_for(self, prediction: str, name: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while (text := self.marker(prediction, name)) is None:
            assert time.monotonic() < deadline, f"{prediction}: no {name!r} marker within {timeout} s"
            time.sleep(0.01)
        return text

    def _write(self, prediction: str, name: str, text: str) -> None:
        path = self.folder / f"{prediction}.{name}"
        scratch = path.with_name(path.name + ".tmp")
        scratch.write_text(text)
        scratch.replace(path)


@dataclass
class CogServer:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path
    stats_path: Path  # the core writes vLLM's own running-request count here (BUNDLE_ENGINE_STATS_FILE)
    holds: Holds | None = None  # with HOLD_RUNNER_REF

    def engine_running_requests(self) -> int:
        """What the engine itself holds, read without going through coglet's dispatch."""
        return int(json.loads(self.stats_path.read_bytes())["engine_running_requests"])

    @property
    def held(self) -> Holds:
        assert self.holds is not None, "this server runs no hold runner"
        return self.holds


@contextlib.contextmanager
def running_cog_server(
    log_dir: Path, ready_within_s: float = 240, runner: str = RUNNER_REF, **env: str
) -> Iterator[CogServer]:
    """The runner under the real coglet (4 slots unless COG_MAX_CONCURRENCY is given), its
    engine's stats in a file; `env` on top. The hold runner gets its hold folder in `log_dir`."""
    port = free_port()
    log_path = log_dir / "server.log"
    stats_path = log_path.with_name("engine-stats.json")
    holds = None
    if runner == HOLD_RUNNER_REF:
        (log_dir / "holds").mkdir()
        holds = Holds(log_dir / "holds")
        env = {HOLD_DIR_VARIABLE: str(holds.folder), **env}
    env = {"COG_MAX_CONCURRENCY": "4", "BUNDLE_ENGINE_STATS_FILE": str(stats_path), **env}
    process = launch(runner, port, log_path, ROOT, env)
    server = CogServer(f"http://127.0.0.1:{port}", process, log_path, stats_path, holds)
    try:
        wait_ready(server, timeout=ready_within_s)
        yield server
    finally:
        stop(process)


def launch(
    runner_ref: str, port: int, log_path: Path, cwd: Path, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    """`python -m cog.server.http` serving `runner_ref`, as Replicate's image runs it."""
    full_env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",  # worker: `python`
        "COG_PREDICT_TYPE_STUB": runner_ref,
        "PORT": str(port),
        **env,
    }
    with log_path.open("wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "cog.server.http", "--host", "127.0.0.1"],
            cwd=cwd,
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            # A process group to kill, not a new session: a session is its own CPU group under
            # autogroup scheduling, where vLLM's spinning CPU engine starves coglet (docs/cog.md).
            process_group=0,
        )


def wait_ready(server: CogServer, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            status = httpx.get(f"{server.url}/health-check", timeout=5).json()["status"]
        except (httpx.HTTPError, ValueError, KeyError):
            status = None
        if status == "READY":
            return
        if status == "SETUP_FAILED" or server.process.poll() is not None:
            break
        time.sleep(0.5)
    raise AssertionError(f"cog server not ready; log:\n{server.log_path.read_text()[-4000:]}")


def stop(process: subprocess.Popen[bytes]) -> None:
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)  # the server, its worker and vLLM's engine core
        except ProcessLookupError:
            return
        try:
            process.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def health_status(url: str) -> str:
    return str(httpx.get(f"{url}/health-check", timeout=15).json()["status"])


def probe(url: str) -> dict[str, Any]:
    """A one-token prediction; its metrics say what the engine held when it arrived. Coglet
    dispatches it after everything sent before it, so it also lets earlier work settle."""
    response = httpx.post(f"{url}/predictions", json={"input": {"prompt": "ping", "max_tokens": 1}}, timeout=60)
    assert response.status_code == 200, response.text
    return dict(response.json())


# --- SSE -------------------------------------------------------------------------------------------
@dataclass
class Stream:
    """One SSE prediction as the client saw it; times are seconds since the test's clock."""

    status_code: int = 0
    chunks: list[str] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)
    completed: dict[str, Any] | None = None
    started_at: float = 0.0
    ended_at: float = 0.0
    first_chunk: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def duration(self) -> float:
        return self.ended_at - self.started_at

    @property
    def first_output_after(self) -> float:
        return self.chunk_times[0] - self.started_at

    @property
    def text(self) -> str:
        return "".join(self.chunks)


async def sse_prediction(
    client: httpx.AsyncClient,
    url: str,
    inputs: dict[str, Any],
    clock: float,
    prediction_id: str | None = None,
    stream: Stream | None = None,
) -> Stream:
    """Run one prediction over SSE (PUT with an id, else POST); `stream.first_chunk` is set when
    its first output arrives."""
    stream = stream or Stream()
    stream.started_at = time.monotonic() - clock
    method, path = ("PUT", f"/predictions/{prediction_id}") if prediction_id else ("POST", "/predictions")
    async with client.stream(
        method, f"{url}{path}", json={"input": inputs}, headers={"Accept": "text/event-stream"}
    ) as response:
        stream.status_code = response.status_code
        event = None
        if response.status_code == 200:
            async for line in response.aiter_lines():
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:"):
                    _take(stream, event, json.loads(line[5:]), clock)
    stream.ended_at = time.monotonic() - clock
    return stream


def _take(stream: Stream, event: str | None, data: dict[str, Any], clock: float) -> None:
    if event == "output":
        stream.chunks.append(data["chunk"])
        stream.chunk_times.append(time.monotonic() - clock)
        stream.first_chunk.set()
    elif event == "completed":
        stream.completed = data


async def until(predicate: Callable[[], bool], within_s: float, what: str) -> None:
    """Poll (on the test's loop) until `predicate()` holds; fail naming `what` after `within_s`."""
    deadline = time.monotonic() + within_s
    while not predicate():
        assert time.monotonic() < deadline, f"not within {within_s} s: {what}"
        await asyncio.sleep(0.01)


# --- engine death under a prediction ---------------------------------------------------------------
# Engine outputs a killed prediction streams before the gate freezes the engine under it: enough
# for its first SSE outputs, far below any test's max_tokens (the freeze lands within a step or two).
KILL_HOLD_AFTER = 8


async def engine_killed_under_a_prediction(server: CogServer, inputs: dict[str, Any]) -> tuple[Stream, int]:
    """SIGKILL vLLM's engine core while a streaming prediction is inside it, and let the
    prediction meet the death. The prediction is held by the gate with the engine frozen
    (tests/gate.py), so vLLM still holds the request when its core dies, however fast the engine
    would have finished it; it is let go once coglet reports UNHEALTHY. Returns the prediction as
    the client saw it and vLLM's own count of running requests (the stats file) at the kill."""
    with server.held.gate.hold(after=KILL_HOLD_AFTER, freeze_engine=True) as held:
        inputs = {**inputs, "prompt": held.prompt(str(inputs["prompt"]))}
        async with httpx.AsyncClient(timeout=120) as client:
            task = asyncio.create_task(sse_prediction(client, server.url, inputs, time.monotonic()))
            await held.until_held()
            await until(lambda: server.engine_running_requests() == 1, 60, "vLLM holds the prediction")
            running = server.engine_running_requests()
            kill_engine_cores(server)
            await until_unhealthy(client, server.url, within_s=60)
            held.release()
            return await task, running


async def until_unhealthy(client: httpx.AsyncClient, url: str, within_s: float) -> None:
    """Poll coglet's health check until it says UNHEALTHY (the runner saw the engine die)."""
    deadline = time.monotonic() + within_s
    while (await client.get(f"{url}/health-check")).json()["status"] != "UNHEALTHY":
        assert time.monotonic() < deadline, f"coglet not UNHEALTHY within {within_s} s of the kill"
        await asyncio.sleep(0.05)


def kill_engine_cores(server: CogServer) -> None:
    group = os.getpgid(server.process.pid)
    engine_cores = [
        int(pid) for pid in os.listdir("/proc") if pid.isdigit() and _is_engine_core(int(pid), group)
    ]
    assert engine_cores, "no vLLM engine core process found in the server's process group"
    for pid in engine_cores:
        os.kill(pid, signal.SIGKILL)


def _is_engine_core(pid: int, group: int) -> bool:
    try:
        if os.getpgid(pid) != group:
            return False
        name = Path(f"/proc/{pid}/comm").read_text().strip()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except (OSError, ProcessLookupError):
        return False
    return "EngineCore" in name or "EngineCore" in cmdline


# --- webhooks (predictions sent with `Prefer: respond-async`) ----------------------------------------
class Webhooks:
    """A local receiver for coglet's webhooks: each prediction's last payload, by id."""

    def __init__(self) -> None:
        self.url = ""
        self.payloads: dict[str, dict[str, Any]] = {}

    def terminal(self, prediction: str) -> dict[str, Any] | None:
        payload = self.payloads.get(prediction)
        if payload is None or payload.get("status") not in ("succeeded", "failed", "canceled"):
            return None
        return payload

    async def _receive(self, request: web.Request) -> web.Response:
        payload = await request.json()
        self.payloads[str(payload["id"])] = payload
        return web.Response(text="ok")


@contextlib.asynccontextmanager
async def webhook_receiver() -> AsyncIterator[Webhooks]:
    hooks = Webhooks()
    app = web.Application()
    app.router.add_post("/hook", hooks._receive)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    hooks.url = f"http://127.0.0.1:{port}/hook"
    try:
        yield hooks
    finally:
        await runner.cleanup()


async def put_async(client: httpx.AsyncClient, prediction: str, inputs: dict[str, Any], hooks: Webhooks) -> int:
    """PUT /predictions/<id> with `Prefer: respond-async` (coglet answers 202 at once); the
    outcome comes to `hooks`."""
    response = await client.put(
        f"/predictions/{prediction}",
        headers={"Prefer": "respond-async"},
        json={"input": inputs, "webhook": hooks.url, "webhook_events_filter": ["completed"]},
    )
    return response.status_code
