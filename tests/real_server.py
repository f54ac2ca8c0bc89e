"""A real server child process on the tiny model, for tests that end it: `python -m shared.serve`
with its engine behind the test gate (`python -m tests.gated_serve`, tests/gate.py), so a test can
hold a generation mid-way instead of racing the engine.

It runs in its own process group but NOT its own session: with the kernel's autogroup scheduling
a new session is a new CPU group, in which vLLM's spinning engine process starves the API
process (see README, Performance). Its own group lets a test signal "the whole group" (as a
terminal's Ctrl-C or systemd's control-group kill does) without signalling pytest.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
import psutil
import pytest

from bench import startup
from bench.servers import wait_healthy
from shared.server_state import ENGINE_DEAD_EXIT_CODE
from tests.conftest import free_port, long_chat, wait_until
from tests.gate import Gate

START_TIMEOUT_S = 300  # a cold start on the busy 2-core box; ~20 s when quiet


@dataclass
class ServerProcess:
    process: subprocess.Popen[bytes]
    url: str
    log: Path
    gate: Gate  # holds this server's generations

    def engine_core(self) -> psutil.Process:
        return engine_core_of(self.process.pid)

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout=timeout)


def engine_core_of(server_pid: int) -> psutil.Process:
    """vLLM's engine core: the server's child that titles itself EngineCore."""
    for child in psutil.Process(server_pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "EngineCore" in child.name() or "EngineCore" in " ".join(child.cmdline()):
                return child
    raise AssertionError("no engine core child found")


@contextlib.contextmanager
def bundle_server(
    log_dir: Path, environment: dict[str, str] | None = None, **settings: str
) -> Iterator[ServerProcess]:
    """`environment`: variables besides BUNDLE_* `settings` (OTEL_*, say)."""
    port = free_port()
    env = {
        **os.environ,
        "BUNDLE_MAX_MODEL_LEN": "2048",
        "BUNDLE_ENFORCE_EAGER": "true",
        "BUNDLE_LOG_LEVEL": "warning",
        **(environment or {}),
        **{f"BUNDLE_{key.upper()}": value for key, value in settings.items()},
    }
    log = log_dir / "server.log"
    gate_dir = log_dir / "gate"
    gate_dir.mkdir()
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.gated_serve", "--gate-dir", str(gate_dir), "--port", str(port)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            process_group=0,
        )
        server = ServerProcess(process, f"http://127.0.0.1:{port}", log, Gate(gate_dir))
        try:
            try:
                wait_healthy(server.url, process, START_TIMEOUT_S)
            except RuntimeError as exc:
                raise AssertionError(f"{exc}: {log.read_text()[-2000:]}") from None
            yield server
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


def data_events(lines: Iterator[str]) -> list[str]:
    """The `data:` payloads of an SSE line iterator, to the end of the stream."""
    return [line[6:] for line in lines if line.startswith("data: ")]


def act_mid_stream(
    client: httpx.Client, body: dict, action: Callable[[], object], headers: dict[str, str] | None = None
) -> tuple[list[str], float]:
    """Start a stream, read its first events, run `action` (kill, signal...), read to the end:
    the `data:` payloads after the action, and the time.monotonic() when it ran."""
    with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
        action()
        acted = time.monotonic()
        return data_events(lines), acted


# Engine deltas before a hold: enough for the three events `act_mid_stream` reads first (a delta
# that completes no character carries no text and makes no event).
HOLD_AFTER = 8

# From the kill to the process's exit: the watchdog's poll (0.25 s), the signal settle (0.2 s),
# the error flush (at most 5 s), the 503 linger (2 s), uvicorn's shutdown and the engine's; the
# bound leaves room for a busy 2-core box.
ENGINE_DEATH_EXIT_BOUND_S = 30.0


def kill_engine_core_mid_stream(server: ServerProcess, max_tokens: int) -> float:
    """SIGKILL vLLM's engine core under a running anonymous stream and check what issue 18
    asks: the stream ends with the error event and [DONE], a new request is refused with 503
    (never a 200), /health is 503, the running-requests gauge is reset, and the server exits
    with ENGINE_DEAD_EXIT_CODE. Returns the seconds from the kill to the exit.

    The stream is held with the engine frozen (tests/gate.py), so the request is inside vLLM
    when its core dies, however fast the engine would have finished it."""
    with (
        server.gate.hold(after=HOLD_AFTER, freeze_engine=True) as held,
        httpx.Client(base_url=server.url, timeout=60) as client,
    ):
        body = long_chat(max_tokens=max_tokens, messages=[{"role": "user", "content": held.prompt("go on")}])

        def kill() -> None:
            held.wait_held()
            server.engine_core().send_signal(signal.SIGKILL)
            # Released once the server has seen the death: the stream then meets vLLM's error.
            wait_until(lambda: client.get("/health").status_code == 503, timeout=60)
            held.release()

        rest, killed = act_mid_stream(client, body, kill)
        assert rest[-1] == "[DONE]"
        error = orjson.loads(rest[-2])["error"]
        assert error["code"] == "engine_unavailable", error

        refused = client.post("/v1/chat/completions", json=body)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "engine_unavailable"
        assert client.get("/health").status_code == 503
        assert "bundle_engine_running_requests 0.0" in client.get("/metrics").text

        code = server.wait(timeout=ENGINE_DEATH_EXIT_BOUND_S)
    assert code == ENGINE_DEAD_EXIT_CODE, server.log.read_text()[-3000:]
    return time.monotonic() - killed


# --- one real start, shared: the start-up benchmark's start, ended by SIGTERM to its group -----
@dataclass
class GroupSigterm:
    """What a client saw of a running stream when the server's whole process group got SIGTERM."""

    rest: list[str]  # the stream's `data:` payloads after the signal, to its end
    exit_code: int
    seconds: float  # from the signal to the server's exit
    log: Path


class GatedServeCommands:
    """`subprocess` as bench.startup sees it, but `python -m shared.serve` starts as
    `python -m tests.gated_serve --gate-dir DIR`: the same server, its engine behind the test gate
    (tests/gate.py), so the stream running at the signal can be held inside the engine."""

    # What bench.startup uses of `subprocess` besides Popen, each named.
    DEVNULL, PIPE, STDOUT = subprocess.DEVNULL, subprocess.PIPE, subprocess.STDOUT
    TimeoutExpired, SubprocessError = subprocess.TimeoutExpired, subprocess.SubprocessError
    run = staticmethod(subprocess.run)

    def __init__(self, gate_dir: Path) -> None:
        self.gate_dir = gate_dir

    def Popen(self, command: list[str], **options: object) -> subprocess.Popen[bytes]:  # noqa: N802
        if command[1:3] == ["-m", "shared.serve"]:
            command = [command[0], "-m", "tests.gated_serve", "--gate-dir", str(self.gate_dir), *command[3:]]
        return subprocess.Popen(command, **options)  # type: ignore[call-overload, no-any-return]


@dataclass
class RealStart:
    """One `python -m bench startup --paths eager,wake --runs 1` (one real server start) and how
    its server ended. The benchmark stops every server it starts with SIGTERM to the server's
    whole group; here a long stream is running when that signal arrives (held in the engine: the
    server starts through tests/gated_serve.py, the same `shared.serve` with its engine behind the
    test gate), so the same start also serves the shutdown test (one engine start fewer)."""

    exit_code: int  # the benchmark's
    out: Path  # startup.json and startup.md
    sigterm: GroupSigterm | BaseException


def sigterm_group_mid_stream(url: str, process: subprocess.Popen[bytes], log: Path, gate: Gate) -> GroupSigterm:
    """Start a long stream, read its first events, SIGTERM the whole group, read to the end.

    The stream is held with the engine frozen (tests/gate.py) when the signal comes, so its
    request is inside vLLM however fast the engine would have finished it; it is let go once the
    engine core has exited, and meets the stopped engine while the server drains."""
    signalled: list[float] = []
    with (
        httpx.Client(base_url=url, timeout=60) as client,
        gate.hold(after=HOLD_AFTER, freeze_engine=True) as held,
    ):
        body = long_chat(messages=[{"role": "user", "content": held.prompt("tell me a long story")}])

        def signal_the_group() -> None:
            held.wait_held()
            core = engine_core_of(process.pid)
            signalled.append(time.monotonic())
            os.killpg(process.pid, signal.SIGTERM)
            core.wait(timeout=60)
            held.release()

        rest, _ = act_mid_stream(client, body, signal_the_group, {"X-Request-Id": "group-signal"})
        code = process.wait(timeout=30)
    return GroupSigterm(rest, code, time.monotonic() - signalled[0], log)


def start_through_the_benchmark(base: Path) -> RealStart:
    """Run the start-up benchmark's eager path once; stop its server mid-stream (see RealStart)."""
    out, work, gate_dir = base / "out", base / "work", base / "gate"
    seed_model_info_cache(work / "warm-cache")
    gate_dir.mkdir()
    ended: list[GroupSigterm | BaseException] = []
    stop_group = startup._stop_group

    def stop_mid_stream(process: subprocess.Popen[bytes]) -> None:
        try:
            port = process.args[process.args.index("--port") + 1]  # type: ignore[union-attr]
            url = f"http://127.0.0.1:{port}"
            ended.append(sigterm_group_mid_stream(url, process, work / "eager-1.log", Gate(gate_dir)))
        except Exception as exc:  # reported by the shutdown test, not swallowed
            ended.append(exc)
        finally:
            stop_group(process)  # the benchmark's own stop: whatever is left of the group goes

    # Small engine (few sequences), but room for the shutdown test's 1,500-token stream.
    small = {"BUNDLE_MAX_NUM_SEQS": "8", "BUNDLE_MAX_MODEL_LEN": "2048"}
    with pytest.MonkeyPatch.context() as monkeypatch:
        for name, value in small.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setattr(startup, "_stop_group", stop_mid_stream)
        monkeypatch.setattr(startup, "subprocess", GatedServeCommands(gate_dir))
        args = ["--paths", "eager,wake", "--runs", "1", "--out", str(out), "--work", str(work)]
        code = startup.main([*args, "--timeout", "600"])
    return RealStart(code, out, ended[0] if ended else AssertionError("the benchmark stopped no server"))


def seed_model_info_cache(cache_root: Path) -> None:
    """Copy vLLM's model-info cache (what it learnt about the model's class) into the start's
    empty cache folder, if this machine has one. Without it vLLM inspects the class in a
    subprocess that imports vLLM once more (~12 s of CPU here); the benchmark's eager path
    normally runs on the cache its earlier paths warmed, so this is the start it measures."""
    from vllm import envs

    found = Path(envs.VLLM_CACHE_ROOT) / "modelinfos"
    if found.is_dir():
        shutil.copytree(found, cache_root / "modelinfos", dirs_exist_ok=True)
