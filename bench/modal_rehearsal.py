"""Modal rehearsal: the real `modal_app.app.Server` run through Modal's own container code on one
event loop (`bench/modal_container.py`), with snapshots on or off, and what each phase costs.

Snapshots on: the snap=True hook starts, warms up and puts the engine to sleep; at the snapshot
point the GPU memory held is read; the snap=False hook wakes it; the class's ASGI app is served
(uvicorn on the container's loop) and its first streamed token is timed from the restore. The
never-slept baseline is measured on the same engine inside the snap=True hook, after its
warm-up and just before its sleep (a tap on `EngineLifecycle.sleep`: the hook has no seam
there, and one engine start is what the GPU time allows); the same measurements follow the
wake-up: temperature-0 token ids of fixed prompts, output tok/s of N concurrent streams and of
one stream. Snapshots off: the same container without hooks; the app's lifespan starts the
engine. Then the exit hooks, and a check that no task or child process is left.

    python -m bench.modal_rehearsal --snapshots on --out bench/gpu-results/modal
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import logging
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any

from bench.loadgen import run_level
from bench.modal_container import ContainerRecorder, run_container
from bench.workload import Workload

SCHEMA = "bundle-modal-rehearsal/1"
BARS = {"wake_to_first_token_s": 1.5, "tokens_per_s_ratio": 0.98}  # the H200 acceptance bars
log = logging.getLogger("bench.modal_rehearsal")


def load_app(snapshots: bool) -> ModuleType:
    """Import modal_app.app as `modal deploy` would, with BUNDLE_MODAL_SNAPSHOT set first (the
    module reads its settings at import)."""
    os.environ["BUNDLE_MODAL_SNAPSHOT"] = "true" if snapshots else "false"
    sys.modules.pop("modal_app.app", None)
    return importlib.import_module("modal_app.app")


def hook_names(modal_cls: Any) -> dict[str, list[str]]:
    """The class's lifecycle and web methods, found by Modal's own flags (as its container does)."""
    from modal._partial_function import _find_partial_methods_for_user_cls, _PartialFunctionFlags

    flags = {
        "enter_pre_snapshot": _PartialFunctionFlags.ENTER_PRE_SNAPSHOT,
        "enter_post_snapshot": _PartialFunctionFlags.ENTER_POST_SNAPSHOT,
        "asgi_app": _PartialFunctionFlags.WEB_INTERFACE,
        "exit": _PartialFunctionFlags.EXIT,
    }
    user_cls = modal_cls._get_user_cls()
    return {name: sorted(_find_partial_methods_for_user_cls(user_cls, flag)) for name, flag in flags.items()}


def gpu_memory_used_mib() -> int | None:
    """GPU memory in use on GPU 0, all processes (vLLM's engine core is a child process), from
    nvidia-smi so this process never opens a CUDA context of its own. None without a GPU."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    query = [smi, "--query-gpu=memory.used", "--format=csv,noheader,nounits", "--id=0"]
    result = subprocess.run(query, capture_output=True, text=True, timeout=30, check=False)
    return int(result.stdout.strip()) if result.returncode == 0 else None


# --- engine-level figures: the same on both sides of the sleep ---------------------------------
class Figures:
    """What is measured before the sleep and after the wake-up, on the engine itself."""

    def __init__(self, args: argparse.Namespace, vocab: int, model: str) -> None:
        self.args = args
        self.workload = Workload(args.prompt_tokens, args.output_tokens, vocab, seed=28, model=model)
        self.fixed = Workload(args.prompt_tokens, args.fixed_tokens, vocab, seed=29).prompts(
            args.fixed_prompts, "fixed"
        )

    async def measure(self, engine: Any, side: str) -> dict[str, Any]:
        from bench.requesters import engine_requester
        from bench.sleepwake import token_ids

        started = time.perf_counter()
        ids = await token_ids(engine, self.fixed, self.args.fixed_tokens)
        requester = engine_requester(engine.llm, self.workload)
        many, one = [], []
        for round_ in range(self.args.rounds):  # fresh prompts each wave: no prefix-cache hits
            batch = self.workload.prompts(self.args.streams, f"{side}/many/{round_}")
            many.append(await run_level(requester, batch, self.args.streams))
            one.append(await run_level(requester, self.workload.prompts(1, f"{side}/one/{round_}"), 1))
        return {
            "token_ids": ids,
            "tokens_per_s_many": [round(level["output_tokens_per_s"], 1) for level in many],
            "tokens_per_s_one": [round(level["output_tokens_per_s"], 1) for level in one],
            "errors": sum(level["errors"] for level in many + one),
            "seconds": round(time.perf_counter() - started, 2),
        }


@contextlib.contextmanager
def before_sleep(probe: Callable[[Any], Awaitable[None]]) -> Iterator[None]:
    """Run `probe(engine)` inside the snap=True hook, after warm-up, just before the sleep."""
    from shared.lifecycle import EngineLifecycle

    original = EngineLifecycle.sleep

    async def sleep(self: EngineLifecycle) -> float:
        await probe(self._engine())
        return await original(self)

    EngineLifecycle.sleep = sleep  # type: ignore[method-assign]
    try:
        yield
    finally:
        EngineLifecycle.sleep = original  # type: ignore[method-assign]


# --- serving the class's ASGI app on the container's loop ---------------------------------------
async def serve(
    app: Any, client_work: Callable[[str, str], dict[str, Any]], engine_work: Any = None
) -> dict[str, Any]:
    """Serve `app` with uvicorn on this loop (the container's); run `client_work(base_url, part)`
    in a thread with its own loop, as Modal's proxy is outside the container's loop: the first
    request, then the HTTP load. With `engine_work(side)`, the engine's own figures are taken on
    this loop twice: right after that first token (the bar: the engine after its wake-up, with
    nothing else running, as before the sleep) and again after the HTTP load."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    # Modal's LifespanManager already ran the app's lifespan: uvicorn must not run it again.
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False))
    serving = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if serving.done():
                serving.result()
                raise RuntimeError("uvicorn stopped before it started")
            await asyncio.sleep(0.01)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        result = await asyncio.to_thread(client_work, url, "first")
        if engine_work is not None:
            result["engine_after_wake"] = await engine_work("after")
        result |= await asyncio.to_thread(client_work, url, "load")
        if engine_work is not None:
            result["engine_after_http_load"] = await engine_work("after-http")
        return result
    finally:
        server.should_exit = True
        await serving
        sock.close()


def http_client_work(
    args: argparse.Namespace, model: str, api_key: str | None
) -> Callable[[str, str], dict[str, Any]]:
    """Part "first": the first served token (timed on the shared clock); part "load": N streams,
    then one stream, over HTTP."""
    from bench.requesters import http_requester, load_client

    workload = Workload(args.prompt_tokens, args.output_tokens, args.vocab, seed=30, model=model)

    async def first(url: str) -> dict[str, Any]:
        async with load_client(url) as client:
            requester = http_requester(client, workload, api_key)
            sent = time.perf_counter()
            reply = await requester(workload.prompts(1, "first")[0])
        if not reply.ok:
            raise RuntimeError(f"the first request failed: {reply.error}")
        ttft = reply.first_token_s
        return {"first_token_at": sent + ttft, "first_request_ttft_s": round(ttft, 4)}

    async def load(url: str) -> dict[str, Any]:
        async with load_client(url) as client:
            requester = http_requester(client, workload, api_key)
            many = await run_level(requester, workload.prompts(args.streams, "http/many"), args.streams)
            one = await run_level(requester, workload.prompts(1, "http/one"), 1)
        return {
            "http_tokens_per_s_many": round(many["output_tokens_per_s"], 1),
            "http_tokens_per_s_one": round(one["output_tokens_per_s"], 1),
            "http_ttft_p50_many_s": round(many["ttft_s"]["p50"], 4),
            "http_errors": many["errors"] + one["errors"],
        }

    parts = {"first": first, "load": load}
    return lambda url, part: asyncio.run(parts[part](url))


# --- one run --------------------------------------------------------------------------------------
def rehearse(args: argparse.Namespace) -> dict[str, Any]:
    import uvicorn  # noqa: F401  imported before the clock starts: a container has no uvicorn to start

    from shared.engine.vllm_startup import sleep_mode_available

    snapshots = args.snapshots == "on"
    module = load_app(snapshots)
    settings = module.SETTINGS
    api_key = settings.api_key.get_secret_value() if settings.api_key else None
    never_slept: dict[str, Any] = {}
    memory: dict[str, int | None] = {}

    async def probe(engine: Any) -> None:
        memory["awake_mib"] = gpu_memory_used_mib()
        figures = Figures(args, engine.info.vocab_size or args.vocab, settings.model_name)
        never_slept.update(await figures.measure(engine, "before"))
        never_slept["figures"] = figures

    def at_snapshot() -> None:
        memory["asleep_mib"] = gpu_memory_used_mib()

    recorder = ContainerRecorder(on_snapshot=at_snapshot)
    started = time.perf_counter()
    tap = before_sleep(probe) if snapshots else contextlib.nullcontext()
    with tap, run_container(module.Server, recorder, snapshots=snapshots) as container:
        engine_work = None
        if snapshots:
            engine = container.instance.lifecycle.engine
            engine_work = lambda side: never_slept["figures"].measure(engine, side)  # noqa: E731
        served = container.loop.run(
            serve(container.asgi_app, http_client_work(args, settings.model_name, api_key), engine_work)
        )
        on_loop = engine_loop_is(container, snapshots)
    ended = time.perf_counter()
    children = leftover_children()
    return summarise(args, recorder, served, never_slept, memory, started, ended) | {
        "snapshots": snapshots,
        "hooks": hook_names(module.Server),
        "engine_on_container_loop": on_loop,
        "sleep_mode": sleep_mode_available(),
        "leftover_tasks": recorder.leftover_tasks,
        "leftover_child_processes": children,
        "model": settings.model_name,
        "total_s": round(ended - started, 1),
    }


def engine_loop_is(container: Any, snapshots: bool) -> bool:
    """Whether the engine that served the app is on the container's loop (vLLM's output handler
    is a task of the loop the engine started on) and, with snapshots, is the hooks' engine."""
    served = container.asgi_app.state.service.engine.inner  # inside the core's GuardedEngine
    handler = getattr(served.llm, "output_handler", None)
    same = not snapshots or served is container.instance.lifecycle.engine
    return same and handler is not None and handler.get_loop() is container.loop.loop


def leftover_children(wait_s: float = 15.0) -> list[str]:
    """Child processes still alive after the exit hooks (vLLM's engine core must be gone).
    Python's multiprocessing resource tracker is not counted: it is started once per process and
    ends with it, whatever the engine did."""
    import psutil

    deadline = time.monotonic() + wait_s
    while True:
        alive = [f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in _live_children(psutil)]
        alive = [line for line in alive if "resource_tracker" not in line]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)


def _live_children(psutil: Any) -> list[Any]:
    children = []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            if child.status() != psutil.STATUS_ZOMBIE:
                children.append(child)
    return children


def summarise(
    args: argparse.Namespace,
    recorder: ContainerRecorder,
    served: dict[str, Any],
    never_slept: dict[str, Any],
    memory: dict[str, int | None],
    started: float,
    ended: float,
) -> dict[str, Any]:
    snapshots = args.snapshots == "on"
    phases = {p.name: round(p.seconds, 3) for p in recorder.phases}
    first_token_at = served.pop("first_token_at")
    tap_s = float(never_slept.get("seconds", 0.0))
    result: dict[str, Any] = {
        "order_problems": recorder.order_problems(snapshots),
        "phases_s": phases,
        # The measurement inside the snap=True hook is not part of a start-up: taken out.
        "never_slept_measurement_s": tap_s,
        "time_to_first_token_s": round(first_token_at - started - tap_s, 3),
        "served": served,
    }
    if snapshots:
        # Wake -> first token as a container sees it: Modal's phases after the restore (the
        # snap=False hook, the asgi_app call, the lifespan), then the first request's TTFT. The
        # wall time from the restore also holds this rehearsal's own uvicorn and client start,
        # which a container does not have (Modal's proxy is running already): kept beside it.
        after = ("enter_post_snapshot", "asgi_app", "lifespan_startup")
        wake = sum(recorder.phase(name).seconds for name in after) + served["first_request_ttft_s"]
        result["wake_to_first_token_s"] = round(wake, 3)
        result["restore_to_first_token_wall_s"] = round(first_token_at - recorder.events["restored"], 3)
        result["gpu_memory_mib"] = {**memory, "note": "nvidia-smi, GPU 0, all processes"}
        result |= compare(never_slept, served.pop("engine_after_wake"))
        # The same engine figures once more after the HTTP load (not a bar: what serving left).
        later = compare(never_slept, served.pop("engine_after_http_load"))
        result["after_http_load"] = {
            **later["after_wake"],
            "token_ids_identical": later["token_ids_identical"],
            "tokens_per_s_ratio_many": later["tokens_per_s_ratio_many"],
            "tokens_per_s_ratio_one": later["tokens_per_s_ratio_one"],
        }
        result["bars"] = bars(result)
    return result


def compare(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    def ratio(key: str) -> float:
        return round(statistics.median(after[key]) / statistics.median(before[key]), 4)

    keep = ("tokens_per_s_many", "tokens_per_s_one", "errors", "seconds")
    return {
        "never_slept": {k: before[k] for k in keep},
        "after_wake": {k: after[k] for k in keep},
        "token_ids_identical": before["token_ids"] == after["token_ids"],
        "fixed_prompts": len(before["token_ids"]),
        "tokens_per_s_ratio_many": ratio("tokens_per_s_many"),
        "tokens_per_s_ratio_one": ratio("tokens_per_s_one"),
    }


def bars(result: dict[str, Any]) -> dict[str, Any]:
    """The H200 acceptance bars, each with its value and pass/fail."""
    wake = result["wake_to_first_token_s"]
    checks = {
        "wake_to_first_token_s<=1.5": (wake, wake <= BARS["wake_to_first_token_s"]),
        "token_ids_identical": (result["token_ids_identical"], result["token_ids_identical"]),
        "tokens_per_s_after_wake/never_slept>=0.98 (many streams)": (
            result["tokens_per_s_ratio_many"],
            result["tokens_per_s_ratio_many"] >= BARS["tokens_per_s_ratio"],
        ),
        "tokens_per_s_after_wake/never_slept>=0.98 (one stream)": (
            result["tokens_per_s_ratio_one"],
            result["tokens_per_s_ratio_one"] >= BARS["tokens_per_s_ratio"],
        ),
        "gpu_memory_asleep_reported": (
            result["gpu_memory_mib"]["asleep_mib"],
            result["gpu_memory_mib"]["asleep_mib"] is not None,
        ),
    }
    return {name: {"value": value, "pass": ok} for name, (value, ok) in checks.items()}


def verdict(run: dict[str, Any]) -> list[str]:
    """Why this run fails (empty: it passes). The bars count only where sleep mode exists."""
    problems = list(run["order_problems"])
    if not run["engine_on_container_loop"]:
        problems.append("the engine runs on another loop than the container's")
    if run["leftover_tasks"] or run["leftover_child_processes"]:
        problems.append("something was left running after the exit hooks")
    if run["served"]["http_errors"]:
        problems.append(f"{run['served']['http_errors']} HTTP requests failed")
    if run["snapshots"]:
        if not run["token_ids_identical"]:
            problems.append("token ids differ after the wake-up")
        if run["sleep_mode"]:
            problems += [f"bar failed: {name}" for name, bar in run["bars"].items() if not bar["pass"]]
    return problems


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.modal_rehearsal", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--snapshots", choices=("on", "off"), required=True)
    parser.add_argument("--out", type=Path, required=True, help="writes modal.json here (runs merged by key)")
    parser.add_argument("--streams", type=int, default=64, help="concurrent streams per wave")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3, help="waves on each side of the sleep (median)")
    parser.add_argument("--fixed-prompts", type=int, default=8, help="temperature-0 prompts compared")
    parser.add_argument("--fixed-tokens", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=1000, help="prompt token ids below this (HTTP load)")
    args = parser.parse_args(argv)
    counts = (args.streams, args.prompt_tokens, args.output_tokens, args.rounds, args.fixed_prompts, args.vocab)
    if min(counts) < 1:
        parser.error("counts must be at least 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run = rehearse(args)
    run["problems"] = verdict(run)
    if not run["sleep_mode"]:
        run["sleep_note"] = "no sleep mode on this platform (vLLM's CPU build): sleep and wake-up were no-ops"
    write(args.out, args.snapshots, run)
    print(json.dumps(run, indent=2))
    return 1 if run["problems"] else 0


def write(out: Path, key: str, run: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "modal.json"
    report: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {"schema": SCHEMA, "runs": {}}
    report["created"] = datetime.now(UTC).isoformat(timespec="seconds")
    report["runs"][key] = run
    path.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
