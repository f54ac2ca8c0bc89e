"""The serving layer's own CPU per token, without vLLM.

    python -m bench stepped --env BUNDLE_STREAM_BATCH_AT=64 --runs 3 --out results/cpu/stepped

serves the bundle's app over `SteppedEngine` and loads it with the benchmark's HTTP client: every
`--step-ms` each running generation gets one token, as vLLM's engine steps hand them out, and a
per-request stream interval is honoured as vLLM 0.32 on does. What the server process then
spends per output token is the bundle's own cost (HTTP parsing, admission, its producer, event
log and SSE writes, uvicorn), which on a GPU machine comes on top of vLLM's output processing in
the same process. Runs alternate the baseline and the variant (`--env NAME=value ...`), so a
shared machine's drift hits both; each run gets a fresh server.

The engine here is a measuring instrument, not a stand-in for vLLM in any test of behaviour: it
generates no text worth reading and has no prefill, so TTFT is only the serving path's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import orjson

from bench.levels import Meters
from bench.servers import free_port, process_cpu_s, running_server
from bench.workload import Workload
from shared.engine.contract import Engine, EngineDelta, EngineInfo, OutputConstraint, SamplingRequest
from shared.engine.lora import Adapter
from shared.errors import InvalidRequest

BASELINE = "baseline"


class SteppedEngine(Engine):
    """`shared.engine.contract.Engine` that gives every running generation one token per step
    (its optional members keep the protocol's defaults)."""

    def __init__(self, step_s: float, vocab_size: int = 1000) -> None:
        self.info = EngineInfo(model_name="stepped", max_model_len=4096, vocab_size=vocab_size)
        self.paces_each_request = True
        self._step_s = step_s
        self._running: dict[str, asyncio.Queue[None]] = {}
        self._stepper: asyncio.Task[None] | None = None

    def tokenize(self, prompt: str) -> list[int]:
        return [16 + len(word) for word in prompt.split()] or [16]

    def render_chat(self, messages: Sequence[dict[str, Any]], tools: object = None) -> list[int]:
        return self.tokenize(" ".join(str(m.get("content", "")) for m in messages))

    def tool_parser(self, tools: Sequence[dict[str, Any]]) -> Any:
        raise NotImplementedError("the stepped engine serves no tools")

    def check_constraint(self, constraint: OutputConstraint, param: str) -> None:
        # Its " tok" tokens follow no schema: a constrained request is the client's 400.
        raise InvalidRequest(f"{param}: the stepped engine enforces no output format", param=param)

    async def generate(self, request_id: str, request: SamplingRequest) -> AsyncIterator[EngineDelta]:
        if self._stepper is None:
            self._stepper = asyncio.get_running_loop().create_task(self._step_forever())
        steps: asyncio.Queue[None] = asyncio.Queue()
        self._running[request_id] = steps
        every, produced, pending = request.stream_interval or 1, 0, 0
        try:
            while produced < request.max_tokens:
                await steps.get()
                produced, pending = produced + 1, pending + 1
                last = produced == request.max_tokens
                # vLLM's rule: the first and the last output at once, the others every `every`.
                if produced == 1 or last or pending >= every:
                    yield EngineDelta(" tok" * pending, pending, "length" if last else None)
                    pending = 0
        finally:
            del self._running[request_id]

    async def _step_forever(self) -> None:
        while True:
            await asyncio.sleep(self._step_s)
            for steps in self._running.values():
                steps.put_nowait(None)

    def healthy(self) -> bool:
        return True

    def ready(self) -> bool:
        return True

    def running_requests(self) -> int:
        return len(self._running)

    async def sleep(self) -> None:
        return None

    async def wake_up(self) -> None:
        return None

    async def add_adapter(self, adapter: Adapter) -> None:
        raise InvalidRequest(f"the stepped engine serves no LoRA adapters ({adapter.name!r})")

    async def remove_adapter(self, adapter: Adapter) -> None:
        return None  # none is ever added


def serve(port: int, step_s: float) -> int:
    """The bundle's server over the stepped engine (settings from BUNDLE_* as usual)."""
    from shared.http.api import create_app
    from shared.http.process import run_server
    from shared.settings import Settings

    settings = Settings(port=port, access_log=False, warm_up=False)
    return run_server(
        settings,
        lambda exit_with: create_app(settings, engine_factory=_opened_stepped(step_s), request_exit=exit_with),
    )


def _opened_stepped(step_s: float) -> Callable[[Any], AbstractAsyncContextManager[SteppedEngine]]:
    """An engine factory for the app's lifespan that, as the vLLM engine's start does, freezes the
    heap start-up leaves: garbage collections then walk only what serving keeps alive."""
    from shared.engine.vllm_startup import freeze_startup_heap

    @asynccontextmanager
    async def opened(settings: Any) -> AsyncIterator[SteppedEngine]:
        freeze_startup_heap()
        yield SteppedEngine(step_s)

    return opened


async def one_run(variant: dict[str, str], args: argparse.Namespace, log: Path) -> dict[str, Any]:
    from bench.targets import bench_http
    from shared.settings import Settings

    port = free_port()
    command = [sys.executable, "-m", "bench.stepped", "serve", str(port), str(args.step_ms / 1000)]
    env = {**os.environ, **variant}
    workload = Workload(16, args.output_tokens, 1000, model=Settings().model_name)  # the name it serves
    with running_server(command, port, log, env) as pid:
        meters = Meters(serving_cpu=lambda: process_cpu_s(pid))
        (level,) = await bench_http(
            f"http://127.0.0.1:{port}", workload, [args.streams], 1, clients=args.clients, meters=meters
        )
    return {
        "cpu_ms_per_token": level["serving_cpu_ms_per_token"],
        "output_tokens_per_s": level["output_tokens_per_s"],
        "ttft_p50_s": level["ttft_s"]["p50"],
        "itl_s": level["itl_s"],
        "errors": level["errors"],
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    variants = {BASELINE: {}, " ".join(args.env): dict(item.split("=", 1) for item in args.env)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    for attempt in range(args.runs):
        for name, variant in variants.items():  # alternating: drift hits both
            log = out / f"server-{attempt}-{'variant' if variant else BASELINE}.log"
            runs[name].append(asyncio.run(one_run(variant, args, log)))
            print(f"{name}: {runs[name][-1]['cpu_ms_per_token']:.4f} ms/token", flush=True)
    report = {
        "schema": "bundle-stepped/1",
        "streams": args.streams,
        "output_tokens": args.output_tokens,
        "step_ms": args.step_ms,
        "runs": runs,
    }
    (out / "stepped.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    (out / "stepped.md").write_text(markdown(report))
    print(markdown(report))
    return report


def markdown(report: dict[str, Any]) -> str:
    rows = [
        f"{report['streams']} streams, {report['output_tokens']} tokens each, a token per stream every "
        f"{report['step_ms']:g} ms; median (range) of the runs:\n",
        "| variant | server CPU ms per token | tok/s | TTFT p50 ms | ITL p50 ms per event | errors |",
        "|---|---|---|---|---|---|",
    ]
    for name, runs in report["runs"].items():
        cpu = [run["cpu_ms_per_token"] for run in runs]
        rows.append(
            f"| {name} | {statistics.median(cpu):.4f} ({min(cpu):.4f}-{max(cpu):.4f}) "
            f"| {statistics.median(run['output_tokens_per_s'] for run in runs):,.0f} "
            f"| {statistics.median(run['ttft_p50_s'] for run in runs) * 1000:.1f} "
            f"| {statistics.median(run['itl_s']['p50'] for run in runs) * 1000:.1f} "
            f"| {sum(run['errors'] for run in runs)} |"
        )
    return "\n".join(rows) + "\n"


def _setting(text: str) -> str:
    name, equals, _ = text.partition("=")
    if not equals or not name.startswith("BUNDLE_"):
        raise argparse.ArgumentTypeError(f"expected BUNDLE_NAME=value, not {text!r}")
    return text


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench stepped", description=__doc__.split("\n\n")[0])
    p.add_argument("--env", type=_setting, nargs="+", required=True, help="the variant's settings")
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--step-ms", type=float, default=20.0, help="time between engine steps")
    p.add_argument("--runs", type=int, default=3, help="runs of each, alternating")
    p.add_argument("--clients", type=int, default=2, help="client processes")
    p.add_argument("--out", default="results/cpu/stepped")
    return p


def main(argv: list[str]) -> int:
    if argv[:1] == ["serve"] and len(argv) == 3:  # the server process one_run starts
        return serve(int(argv[1]), float(argv[2]))
    args = parser().parse_args(argv)
    if min(args.streams, args.output_tokens, args.runs, args.clients) < 1 or args.step_ms <= 0:
        print("python -m bench stepped: counts must be at least 1 and --step-ms above 0", file=sys.stderr)
        return 2
    measure(args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
