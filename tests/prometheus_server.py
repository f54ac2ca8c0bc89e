"""A real Prometheus for the tests: Debian's `prometheus` (2.42; `make test` installs it), scraping
given targets every second and evaluating given rule files every second, on a free loopback port,
its data in a temporary folder. `query` runs an instant PromQL query through its HTTP API."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.conftest import free_port

START_TIMEOUT_S = 60
INSTALL_HINT = "install Debian's prometheus package (`make prometheus`, as root: apt-get install prometheus)"


def binary(name: str) -> str:
    """`prometheus` or `promtool`, which `make test` installs; a clear failure where it did not."""
    found = shutil.which(name)
    if found is None:
        raise AssertionError(f"{name} is not on PATH: {INSTALL_HINT}")
    return found


@dataclass
class Prometheus:
    url: str
    log: Path

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector (or scalar, as one sample) `expr` gives now; raises on a bad query."""
        answer = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10).json()
        assert answer["status"] == "success", (expr, answer)
        data = answer["data"]
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def targets_up(self) -> bool:
        found = self.query("up")
        return bool(found) and all(sample["value"][1] == "1" for sample in found)


@contextlib.contextmanager
def prometheus(workdir: Path, targets: list[str], rule_files: list[Path]) -> Iterator[Prometheus]:
    """Prometheus scraping `targets` (host:port, /metrics) and evaluating `rule_files`."""
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
        "rule_files": [str(path) for path in rule_files],
        "scrape_configs": [{"job_name": "bundle", "static_configs": [{"targets": targets}]}],
    }
    config_file = workdir / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config))
    port = free_port()
    log = workdir / "prometheus.log"
    command = [
        binary("prometheus"),
        f"--config.file={config_file}",
        f"--storage.tsdb.path={workdir / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    server = Prometheus(f"http://127.0.0.1:{port}", log)
    try:
        _wait_ready(server, process)
        yield server
    finally:
        process.terminate()
        process.wait(30)


def _wait_ready(server: Prometheus, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert process.poll() is None, f"prometheus exited: {server.log.read_text()[-2000:]}"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{server.url}/-/ready", timeout=1).status_code == 200:
                return
        time.sleep(0.1)
    raise AssertionError(f"prometheus not ready within {START_TIMEOUT_S} s: {server.log.read_text()[-2000:]}")
