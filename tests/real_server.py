"""A real `python -m shared.serve` child process on the tiny model, for tests that end it.

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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

from bench.servers import wait_healthy
from tests.conftest import free_port

START_TIMEOUT_S = 300  # a cold start on the busy 2-core box; ~20 s when quiet


@dataclass
class ServerProcess:
    process: subprocess.Popen[bytes]
    url: str
    log: Path

    def engine_core(self) -> psutil.Process:
        """vLLM's engine core: the child that titles itself EngineCore."""
        for child in psutil.Process(self.process.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if "EngineCore" in child.name() or "EngineCore" in " ".join(child.cmdline()):
                    return child
        raise AssertionError("no engine core child found")

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout=timeout)


@contextlib.contextmanager
def bundle_server(log_dir: Path, **settings: str) -> Iterator[ServerProcess]:
    port = free_port()
    env = {
        **os.environ,
        "BUNDLE_MAX_MODEL_LEN": "2048",
        "BUNDLE_ENFORCE_EAGER": "true",
        "BUNDLE_LOG_LEVEL": "warning",
        **{f"BUNDLE_{key.upper()}": value for key, value in settings.items()},
    }
    log = log_dir / "server.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "shared.serve", "--port", str(port)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            process_group=0,
        )
        server = ServerProcess(process, f"http://127.0.0.1:{port}", log)
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


def seed_model_info_cache(cache_root: Path) -> None:
    """Copy vLLM's model-info cache (what it learnt about the model's class) into a start's
    empty cache folder, if this machine has one. Without it vLLM inspects the class in a
    subprocess that imports vLLM once more (~12 s of CPU here); the benchmark's eager path
    normally runs on the cache its earlier paths warmed, so this is the start it measures."""
    from vllm import envs

    found = Path(envs.VLLM_CACHE_ROOT) / "modelinfos"
    if found.is_dir():
        shutil.copytree(found, cache_root / "modelinfos", dirs_exist_ok=True)
