"""Servers as child processes: start, wait for health, measure, always stop.

Also what the benchmark reads about a server from outside: its CPU time (/proc), its memory
high-water mark and the prefill budget its engine logged.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson

from shared.engine.vllm_startup import engine_args
from shared.settings import Settings


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def running_server(command: list[str], port: int, log: Path, env: dict[str, str]) -> Iterator[int]:
    """Start a server, wait for /health, yield its pid, and always stop it."""
    with log.open("wb") as out:
        # Its own process group (so the engine's children die with it) but NOT its own session:
        # with the kernel's autogroup scheduling (on by default) a new session is a new CPU
        # group, and inside it vLLM's spinning CPU-engine processes starve the API process,
        # which then sends whole responses at once (measured; see README, Performance).
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env, process_group=0
        )
        try:
            wait_healthy(f"http://127.0.0.1:{port}", process, timeout_s=900)
            yield process.pid
        finally:
            _stop_group(process)


def _stop_group(process: subprocess.Popen) -> None:
    """SIGTERM the server's group, then SIGKILL whatever of it is left (an engine child can
    outlive a leader that exited)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, 15)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=60)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, 9)


def wait_healthy(base_url: str, process: subprocess.Popen, timeout_s: float, interval_s: float = 0.5) -> None:
    """Poll `GET /health` until it answers 200. Raise RuntimeError if the process exits first
    or `timeout_s` passes (callers add where its log is)."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with {process.returncode} before /health answered 200")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{base_url}/health").status_code == 200:
                    return
            time.sleep(interval_s)
    raise RuntimeError("the server did not answer /health 200 in time")


def bundle_command(port: int) -> list[str]:
    """The bundle's server as the benchmark runs it: no access log, like vLLM's server there
    (`--disable-uvicorn-access-log` in `_vllm_server_base`), so both do the same work."""
    return [sys.executable, "-m", "shared.serve", "--port", str(port), "--no-access-log"]


def vllm_server_command(settings: Settings, port: int, api_servers: int | None = None) -> list[str]:
    """vLLM's own server on exactly the engine arguments the bundle resolves (preset included).
    `api_servers`: `vllm serve --api-server-count` (bench/vllm_serve.py), else one API process."""
    from vllm.platforms import current_platform

    args = engine_args(settings, on_cpu=current_platform.is_cpu())
    command = _vllm_server_base(settings, args, port, api_servers) + [
        "--gpu-memory-utilization",
        str(args.gpu_memory_utilization),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--disable-log-stats",  # as the bundle's engine (shared/engine/vllm_startup.py)
    ]
    if args.enforce_eager:
        command.append("--enforce-eager")
    for flag, value in (
        ("--max-num-batched-tokens", args.max_num_batched_tokens),
        ("--quantization", args.quantization),
        ("--block-size", args.block_size),
        ("--stream-interval", _beyond_default(getattr(args, "stream_interval", 1), 1)),
    ):
        if value:
            command += [flag, str(value)]
    if args.enable_prefix_caching is not None:
        command.append(
            "--enable-prefix-caching" if args.enable_prefix_caching else "--no-enable-prefix-caching"
        )
    graphs = getattr(args.compilation_config, "max_cudagraph_capture_size", None)
    if graphs is not None:  # BUNDLE_CUDA_GRAPH_MAX_BATCH: unset, both leave the widths to vLLM
        command += ["--compilation-config", orjson.dumps({"max_cudagraph_capture_size": graphs}).decode()]
    return command


def _beyond_default(value: int, default: int) -> int | None:
    """The value when it differs from vLLM's default, so that a default is never passed as a
    flag (the server might predate it)."""
    return None if value == default else value


def vllm_defaults_command(settings: Settings, port: int) -> list[str]:
    """`vllm serve` as a user runs it: the model, and vLLM's defaults for everything else (its
    stat logging, scheduler and prefix caching included). Only what the machine needs is kept:
    on CPU eager mode and the KV share of host RAM (vLLM's 0.92 fails on small hosts)."""
    from vllm.platforms import current_platform

    on_cpu = current_platform.is_cpu()
    args = engine_args(settings, on_cpu=on_cpu)
    command = _vllm_server_base(settings, args, port)
    if on_cpu:
        command += ["--enforce-eager", "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    return command


def _vllm_server_base(settings: Settings, args: Any, port: int, api_servers: int | None = None) -> list[str]:
    """What every vLLM server run shares: the model, its shape and the load it must serve."""
    entry = ["vllm.entrypoints.openai.api_server"] if api_servers is None else ["bench.vllm_serve"]
    count = [] if api_servers is None else ["--api-server-count", str(api_servers)]
    command = [
        sys.executable,
        "-m",
        *entry,
        *count,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model",
        args.model,
        "--served-model-name",
        settings.model_name,
        "--dtype",
        args.dtype,
        "--load-format",
        args.load_format,
        "--seed",
        str(settings.engine_seed),
        "--disable-uvicorn-access-log",
        # Puts vLLM's own per-request prefix-cache count in the usage chunk (frontend only).
        "--enable-prompt-tokens-details",
    ]
    if args.max_model_len:
        command += ["--max-model-len", str(args.max_model_len)]
    if args.tensor_parallel_size > 1:  # BUNDLE_TENSOR_PARALLEL_SIZE: the engine split as the bundle's
        command += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    return command


def logged_batch_tokens(log: Path) -> int | None:
    """The prefill budget a server's engine resolved, from vLLM's own start-up log line: the
    proof that every target ran the same scheduler, whoever picked the default."""
    found = re.search(r"max_num_batched_tokens'?[=:] ?(\d+)", log.read_text(errors="replace"))
    return int(found.group(1)) if found else None


def peak_rss_mib(pid: int) -> float:
    """The process's resident-memory high-water mark (Linux), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def process_cpu_s(pid: int) -> float:
    """CPU seconds so far of every live thread of `pid`, from the scheduler's nanosecond
    counters (/proc/<pid>/task/*/schedstat); /proc/<pid>/stat counts 10 ms ticks, too coarse for
    a level of a thousand tokens. A thread that exits between two readings takes its time with
    it; servers keep theirs for life."""
    total_ns = 0
    for schedstat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        with contextlib.suppress(OSError):  # the thread ended while we listed
            total_ns += int(schedstat.read_text().split()[0])
    return total_ns / 1e9


def stats_file_counter(path: Path) -> Callable[[], tuple[int, int]]:
    """Reads the bundle's prefix-cache counts (prompt tokens looked up, found) from the file its
    server publishes (shared/engine/stats_file.py), added up over its API processes' files
    (`stats.json`, or `stats.0.json`, `stats.1.json`... with BUNDLE_API_PROCESSES > 1); (0, 0)
    until the first write."""

    def read_one(one: Path) -> tuple[int, int]:
        try:
            snapshot = orjson.loads(one.read_bytes())
        except (OSError, orjson.JSONDecodeError):
            return 0, 0
        return int(snapshot.get("prefix_cache_queries", 0)), int(snapshot.get("prefix_cache_hits", 0))

    def read() -> tuple[int, int]:
        files = [path, *path.parent.glob(f"{path.stem}.[0-9]*{path.suffix}")]
        counts = [read_one(one) for one in files]
        return sum(queries for queries, _ in counts), sum(hits for _, hits in counts)

    return read


def server_cpu_by_role(root_pid: int) -> Callable[[], dict[str, float]]:
    """Reads the CPU seconds so far of a server's processes, by role: `api` (its API processes
    together, and each as `api.<i>`), `engine` (vLLM's engine core and its workers), `other`
    (a supervisor, a local store, multiprocessing's resource tracker). The processes are listed
    now, once the server is up: a server keeps them for life. API processes are the ones titled
    `APIServer_<i>` (the bundle's and vLLM's, with several); with none, the root is the one."""
    import psutil

    api: dict[str, int] = {}  # "api.<i>" -> pid
    roles: dict[str, list[int]] = {"engine": [], "other": []}
    root = psutil.Process(root_pid)
    for process in root.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            title = " ".join(process.cmdline()) or process.name()
            numbered = re.search(r"APIServer_(\d+)", title)
            if numbered:
                api[f"api.{numbered.group(1)}"] = process.pid
            elif "EngineCore" in title or "::Worker" in title:
                roles["engine"].append(process.pid)
            else:
                roles["other"].append(process.pid)
    if api:
        roles["other"].append(root_pid)
    else:
        api["api.0"] = root_pid

    def read() -> dict[str, float]:
        readings = {label: process_cpu_s(pid) for label, pid in sorted(api.items())}
        readings["api"] = sum(readings.values())
        for role, pids in roles.items():
            readings[role] = sum(process_cpu_s(pid) for pid in pids)
        return readings

    return read


def metrics_histogram_above(url: str, name: str, bound: float) -> Callable[[], int]:
    """Reads how many observations of one of the bundle's histograms so far exceeded `bound`
    (one of its bucket bounds) from its /metrics; 0 if it cannot."""
    bucket = f'{name}_bucket{{le="{bound}"}}'

    def read() -> int:
        values = _scraped(url)
        return int(values.get(f"{name}_count", 0.0) - values.get(bucket, 0.0))

    return read


def metrics_histogram_counter(url: str, name: str) -> Callable[[], tuple[float, int]]:
    """Reads one of the bundle's histograms (sum, count) from its /metrics, e.g.
    `bundle_time_to_first_token_seconds`; (0, 0) if it cannot."""

    def read() -> tuple[float, int]:
        values = _scraped(url)
        return values.get(f"{name}_sum", 0.0), int(values.get(f"{name}_count", 0.0))

    return read


def metrics_gc_pauses(url: str) -> Callable[[], dict[str, float]]:
    """Reads the bundle's garbage-collection pauses so far (bundle_gc_pause_seconds): seconds in
    all generations, and how many full collections (generation 2) and their seconds."""
    full = '{generation="2"}'

    def read() -> dict[str, float]:
        values = _scraped(url)
        return {
            "gc_pause_s": sum(v for k, v in values.items() if k.startswith("bundle_gc_pause_seconds_sum{")),
            "gc_full_collections": values.get(f"bundle_gc_pause_seconds_count{full}", 0.0),
            "gc_full_pause_s": values.get(f"bundle_gc_pause_seconds_sum{full}", 0.0),
        }

    return read


def _scraped(url: str) -> dict[str, float]:
    """Every sample of the server's /metrics by its name with labels; empty if it cannot."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    values = {}
    for line in text.splitlines():
        metric, _, value = line.rpartition(" ")  # label values may hold spaces; the value cannot
        if metric and not line.startswith("#"):
            with contextlib.suppress(ValueError):
                values[metric] = float(value)
    return values
