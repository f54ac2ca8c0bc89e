"""`python -m bench lora`: streams spread over LoRA adapters against the same streams on the base.

One bundle server with LoRA on and N random-weight adapters loaded at start (PEFT format, built
here by `shared.models.random_adapter` for the served model's shape). Then, on that one server and with
the same prompts, a level of concurrent streams on the base model and the same level with the
requests naming the adapters in turn, alternating base / adapters `--repeat` times (the median
run of each is kept, every run is in the JSON). Prompts differ from run to run (bench/workload.py),
and the same run number gets the same prompts for both, so the prefix cache favours neither.

    python -m bench lora --adapters 4 --level 64 --out results/cpu/lora
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import re
from collections.abc import AsyncIterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench.client_processes import run_level_in_processes
from bench.levels import LevelRunner, median_run, requests_per_level
from bench.loadgen import run_level
from bench.requesters import http_requester, load_client, open_connections
from bench.servers import bundle_command, free_port, running_server
from bench.targets import WARM_UP_REQUESTS, scheduled
from bench.workload import Workload
from shared.engine.vllm_startup import resolve_model_path
from shared.models.random_adapter import model_config, write_adapter
from shared.settings import Settings

TARGETS = ("base", "lora")


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = Settings()
    names = build_adapters(settings, out / "adapters", args.adapters, args.rank)
    port = free_port()
    env = {**os.environ, **server_env(settings, names, out / "adapters", args.rank), "BUNDLE_PORT": str(port)}
    url = f"http://127.0.0.1:{port}"
    with running_server(bundle_command(port), port, out / "server.log", env):
        _check_models(url, settings.model_name, names)
        runs = asyncio.run(_alternate(url, settings.model_name, names, args))
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
    report = _report(args, settings, names, runs, metrics)
    (out / "lora.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    print(_summary(report), flush=True)
    return 0


def build_adapters(settings: Settings, into: Path, count: int, rank: int) -> list[str]:
    """`count` random adapters for the served model's shape, in its dtype (bf16 on the H200)."""
    config = model_config(Path(resolve_model_path(settings)))
    dtype = "bfloat16" if settings.dtype == "bfloat16" else "float32"  # ("bf16" is no vLLM dtype)
    names = [f"lora-{index}" for index in range(count)]
    for seed, name in enumerate(names, start=1):
        # q/k/v/o: the attention projections fine-tunes usually adapt, all four in the batch's work
        write_adapter(
            into / name,
            config,
            rank=rank,
            seed=seed,
            targets=("q_proj", "k_proj", "v_proj", "o_proj"),
            base=settings.model,
            dtype=dtype,
        )
    return names


def server_env(settings: Settings, names: list[str], into: Path, rank: int) -> dict[str, str]:
    modules = {name: str(into / name) for name in names}
    return {
        "BUNDLE_ENABLE_LORA": "true",
        "BUNDLE_LORA_MODULES": orjson.dumps(modules).decode(),
        "BUNDLE_MAX_LORAS": str(len(names)),
        "BUNDLE_MAX_LORA_RANK": str(rank),
        "BUNDLE_MAX_LOADED_LORAS": str(len(names)),
    }


def _check_models(url: str, base: str, names: list[str]) -> None:
    """Stop at once (not after minutes of errors) if the adapters are not served."""
    listed = {card["id"] for card in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}
    missing = {base, *names} - listed
    if missing:
        raise SystemExit(f"python -m bench lora: the server does not list {sorted(missing)}")


async def _alternate(url: str, base: str, names: list[str], args: argparse.Namespace) -> dict[str, list[dict]]:
    workloads = {
        "base": _workload(args, base, ()),
        "lora": _workload(args, base, tuple(names)),
    }
    runs: dict[str, list[dict]] = {target: [] for target in TARGETS}
    count = requests_per_level(args.level, args.rounds)
    async with contextlib.AsyncExitStack() as stack:
        runners = {
            t: await stack.enter_async_context(_runner(url, w, args.clients)) for t, w in workloads.items()
        }
        for attempt in range(args.repeat):
            # Alternate which goes first, so that neither always follows the other's cache state.
            order = TARGETS if attempt % 2 == 0 else TARGETS[::-1]
            for target in order:
                prompts = workloads[target].prompts(count, f"c{args.level}/r{attempt}")
                result = await runners[target](prompts, args.level)
                runs[target].append(result)
                print(
                    f"  {target:>4} run {attempt}: {result['output_tokens_per_s']:9.1f} tok/s, "
                    f"errors {result['errors']} {result['error_kinds'] or ''}",
                    flush=True,
                )
    return runs


def _workload(args: argparse.Namespace, base: str, models: tuple[str, ...]) -> Workload:
    return Workload(
        args.prompt_tokens, args.output_tokens, args.vocab, seed=args.seed, model=base, models=models
    )


@contextlib.asynccontextmanager
async def _runner(url: str, workload: Workload, clients: int) -> AsyncIterator[LevelRunner]:
    """A level runner: in this process, or split over `clients` processes (one Python client
    tops out near 6k tok/s). Warmed up first: each adapter's first batch is not the bench."""
    async with load_client(url) as client:
        one = http_requester(client, workload)
        warm_up = len(workload.models) or WARM_UP_REQUESTS
        await run_level(one, workload.prompts(warm_up, "warm-up"), warm_up)
        if clients <= 1:
            await open_connections(client, 64)
            yield scheduled(one, workload)
            return
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=clients, mp_context=spawn) as pool:

        async def in_processes(prompts: list[list[int]], level: int) -> dict[str, Any]:
            return run_level_in_processes(pool, url, workload, prompts, level, clients)

        yield in_processes


def _report(
    args: argparse.Namespace, settings: Settings, names: list[str], runs: dict[str, list[dict]], metrics: str
) -> dict[str, Any]:
    kept = {target: median_run(target_runs) for target, target_runs in runs.items()}
    for level in kept.values():
        level.pop("runs_timeline_ms", None)  # per-request timelines: too big for this report
    base, lora = kept["base"]["output_tokens_per_s"], kept["lora"]["output_tokens_per_s"]
    return {
        "schema": "bundle-lora/1",
        "machine": args.machine,
        "model": settings.model_name,
        "adapters": {
            "count": len(names),
            "rank": args.rank,
            "targets": ["q_proj", "k_proj", "v_proj", "o_proj"],
        },
        "workload": vars(args),
        "targets": kept,
        "lora_over_base_tok_s": lora / base if base else None,
        "server_requests_per_model": _per_model(metrics),
    }


def _per_model(metrics: str) -> dict[str, float]:
    """bundle_model_requests_total by model, from the server's /metrics (the spread, as served)."""
    pattern = r'^bundle_model_requests_total\{model="([^"]+)"\} (\S+)$'
    return {model: float(value) for model, value in re.findall(pattern, metrics, re.M)}


def _summary(report: dict[str, Any]) -> str:
    lines = [
        f"{report['adapters']['count']} adapters of rank {report['adapters']['rank']}, "
        f"{report['workload']['level']} streams:"
    ]
    for target, level in report["targets"].items():
        lines.append(
            f"  {target:>4}: {level['output_tokens_per_s']:9.1f} tok/s "
            f"(runs {_rounded(level['runs_output_tokens_per_s'])}), "
            f"TTFT p50 {level['ttft_s']['p50'] * 1000:.1f} ms, ITL p50 {level['itl_s']['p50'] * 1000:.2f} ms, "
            f"errors {level['errors']}"
        )
    ratio = report["lora_over_base_tok_s"]
    lines.append(f"  adapters / base tok/s: {ratio:.3f}" if ratio else "  no base throughput")
    lines.append(f"  requests per model (server): {report['server_requests_per_model']}")
    return "\n".join(lines)


def _rounded(values: list[float]) -> list[float]:
    return [round(value, 1) for value in values]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench lora", description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapters", type=int, default=4, help="adapters the streams are spread over")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank of every adapter")
    parser.add_argument("--level", type=int, default=64, help="concurrent streams")
    parser.add_argument("--rounds", type=int, default=2, help="requests per run = level x rounds, at least 16")
    parser.add_argument(
        "--repeat", type=int, default=3, help="runs per target, alternating; the median is kept"
    )
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=1000, help="prompt ids are drawn below this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clients", type=int, default=1, help="client processes")
    parser.add_argument("--machine", default="", help="how to name the machine in the report")
    parser.add_argument("--out", default="results/cpu/lora")
    return parser
