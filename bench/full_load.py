"""`python -m bench.full_load`: the promises of request identity at full load (issue 48), on a GPU.

Parts, each one device command (bench/gpu.sh `full-load-procs`, `full-load-replicas`):
- `procs`: one server with `--api-processes` API processes (its local valkey carries identity
  between them) on the current BUNDLE_* shape, driven by vLLM's own client (`vllm bench serve`,
  which puts an `x-request-id` on every request) at each `--levels` concurrency, `--runs` runs of
  `--prompts-per-stream` x level unique random prompts each: failed requests (the bar is 0),
  output tok/s, TTFT; and /metrics' store errors and slow round trips. Then, the server stopped,
  vLLM's offline `bench throughput` on the same shape and prompt sizes: the engine's ceiling, which
  the served tok/s is compared with.
- `replicas`: two one-process servers sharing a valkey-server (each `--memory` of the GPU), and
  `bench/identity_burst.py` over both: `--burst` streams with ids, a quarter of them sent again
  to the other replica, `--runs` times: non-2xx (the bar is 0), ids whose clients got different
  bytes, generations started against ids.
The report (`--out`/full-load.json) records the machine line (vLLM, torch, CUDA) it ran on.

    python -m bench.full_load --part procs --levels 8,16 --runs 1 --prompt-tokens 32 --output-tokens 16 \\
        --api-processes 2 --out /tmp/full-load     # CPU, tiny model (a dry run)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench.identity_burst import burst
from bench.redis_overhead import local_store
from bench.servers import bundle_command, free_port, running_server

STORE_METRICS = ("bundle_store_errors_total", "bundle_store_slow_total", "bundle_takeovers_total")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report_path = out / "full-load.json"
    report: dict[str, Any] = orjson.loads(report_path.read_bytes()) if report_path.exists() else {}
    report["machine"] = args.machine or report.get("machine", "")
    if args.part == "procs":
        report["procs"] = _procs(args, out)
    elif args.part == "ceiling":
        report["ceiling"] = _offline_throughput(args, out)
    elif args.part == "replicas":
        report["replicas"] = _replicas(args, out)
    else:  # collect: the report of a run whose command was cut short, from the files it left
        report["procs"] = {"api_processes": args.api_processes, "levels": _levels(out), "server_metrics": None}
        if (out / "offline-throughput.json").exists():
            report["ceiling"] = _ceiling(out / "offline-throughput.json", args.output_tokens)
    if "procs" in report and "ceiling" in report:
        ceiling = report["ceiling"]["output_tok_s"]
        report["procs"]["of_offline"] = {
            str(level["streams"]): round(level["output_tok_s"] / ceiling, 3)
            for level in report["procs"]["levels"]
        }
    report_path.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    shown = "procs" if args.part == "collect" else args.part
    print(orjson.dumps({shown: _summary(report[shown])}, option=orjson.OPT_INDENT_2).decode())
    return 0 if _kept_promises(report.get(shown, {})) else 1


def _kept_promises(part: dict[str, Any]) -> bool:
    """No failed request (procs), no non-2xx and one text per id (replicas)."""
    if "levels" in part:
        return all(run["failed"] == 0 for level in part["levels"] for run in level["runs"])
    if "runs" in part:
        return all(r["non_2xx"] == 0 and not r["differing_ids"] for r in part["runs"])
    return True


# --- procs: vLLM's client against N API processes; the ceiling: vLLM's offline throughput -------------
def _model() -> str:
    from shared.engine.vllm_startup import resolve_model_path
    from shared.settings import Settings

    return str(resolve_model_path(Settings()))


def _procs(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    model = _model()
    port = free_port()
    env = {**os.environ, "BUNDLE_API_PROCESSES": str(args.api_processes), "BUNDLE_PORT": str(port)}
    url = f"http://127.0.0.1:{port}"
    with running_server(bundle_command(port), port, out / "procs-server.log", env):
        for level in args.levels:
            for run in range(args.runs):
                _vllm_bench_serve(args, url, model, level, run, out)
        metrics = _metrics(url)
    return {"api_processes": args.api_processes, "levels": _levels(out), "server_metrics": metrics}


def _levels(out: Path) -> list[dict[str, Any]]:
    """Each level's runs, read back from the results vLLM's client saved (serve-c<level>-r<run>.json)."""
    found: dict[int, list[dict[str, Any]]] = {}
    for path in sorted(out.glob("serve-c*-r*.json")):
        level = int(re.match(r"serve-c(\d+)-r\d+\.json", path.name).group(1))  # type: ignore[union-attr]
        found.setdefault(level, []).append(_serve_result(path))
    return [{"streams": level, "runs": runs, **_medians(runs)} for level, runs in sorted(found.items())]


def _vllm_bench_serve(args: argparse.Namespace, url: str, model: str, level: int, run: int, out: Path) -> None:
    command = [
        sys.executable, str(Path(__file__).with_name("vllm_client.py")),
        "--backend", "openai", "--endpoint", "/v1/completions", "--base-url", url,
        "--model", "tiny", "--tokenizer", model,
        "--dataset-name", "random", "--random-input-len", str(args.prompt_tokens),
        "--random-output-len", str(args.output_tokens), "--ignore-eos",
        "--num-prompts", str(args.prompts_per_stream * level), "--max-concurrency", str(level),
        "--seed", str(1000 * level + run),  # unique prompts per run: no prefix-cache hits between runs
        "--save-result", "--result-dir", str(out), "--result-filename", f"serve-c{level}-r{run}.json",
    ]  # fmt: skip
    with (out / "vllm-bench-serve.log").open("ab") as log:
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False)


def _serve_result(path: Path) -> dict[str, Any]:
    found = json.loads(path.read_text())
    return {
        "completed": int(found.get("completed", 0)),
        "failed": int(found.get("failed", 0)),
        "output_tok_s": float(found.get("output_throughput", 0.0)),
        "ttft_p50_ms": float(found.get("median_ttft_ms", 0.0)),
        "ttft_p99_ms": float(found.get("p99_ttft_ms", 0.0)),
        "errors": [e for e in found.get("errors", []) if e][:5],
    }


def _medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "failed": sum(run["failed"] for run in runs),
        "output_tok_s": statistics.median(run["output_tok_s"] for run in runs),
        "output_tok_s_spread": [min(r["output_tok_s"] for r in runs), max(r["output_tok_s"] for r in runs)],
        "ttft_p50_ms": statistics.median(run["ttft_p50_ms"] for run in runs),
    }


def _offline_throughput(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """vLLM's `bench throughput` on the served shape (the engine alone, no serving layer), on as
    many prompts as one run of the first level sends."""
    from shared.engine.vllm_startup import engine_args
    from shared.settings import Settings

    model = _model()
    resolved = engine_args(Settings(), on_cpu=not _has_cuda())  # the engine arguments the server ran with
    result = out / "offline-throughput.json"
    code = (
        "import sys; from vllm.benchmarks.throughput import add_cli_args, main; "
        "from vllm.utils.argparse_utils import FlexibleArgumentParser as P; "
        "p = P(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))"
    )
    command = [
        sys.executable, "-c", code, "--model", model, "--tokenizer", model,
        "--load-format", str(resolved.load_format), "--dtype", str(resolved.dtype),
        "--dataset-name", "random", "--random-input-len", str(args.prompt_tokens),
        "--random-output-len", str(args.output_tokens),
        "--num-prompts", str(args.prompts_per_stream * args.levels[0]),
        "--max-num-seqs", str(resolved.max_num_seqs), "--max-model-len", str(resolved.max_model_len),
        "--gpu-memory-utilization", str(resolved.gpu_memory_utilization), "--output-json", str(result),
    ]  # fmt: skip
    if resolved.enforce_eager:
        command.append("--enforce-eager")
    with (out / "offline-throughput.log").open("wb") as log:
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=True)
    return _ceiling(result, args.output_tokens)


def _ceiling(result: Path, output_tokens: int) -> dict[str, Any]:
    found = json.loads(result.read_text())
    tokens_per_s = float(found["tokens_per_second"])  # prompt and output tokens
    prompts = int(found["num_requests"])
    output_share = prompts * output_tokens / float(found["total_num_tokens"])
    return {"prompts": prompts, "tokens_per_s": tokens_per_s, "output_tok_s": tokens_per_s * output_share}


def _has_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


# --- replicas: identity bursts over two servers sharing one store ---------------------------------------
def _replicas(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    with local_store(None, out) as redis_url:
        base = {**os.environ, "BUNDLE_REDIS_URL": redis_url}
        if args.memory is not None:
            base["BUNDLE_GPU_MEMORY_UTILIZATION"] = str(args.memory)
        ports = [free_port(), free_port()]
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        servers = [
            running_server(
                bundle_command(port), port, out / f"replica-{name}.log", {**base, "BUNDLE_PORT": str(port)}
            )
            for name, port in zip("ab", ports, strict=True)
        ]
        with servers[0], servers[1]:
            runs = []
            for run in range(args.runs):
                result = asyncio.run(
                    burst(
                        urls, args.burst, args.burst // 4, args.output_tokens, f"full-load-{run}", "completion"
                    )
                )
                runs.append({**vars(result), "statuses": {str(k): v for k, v in result.statuses.items()},
                             "non_2xx": result.non_2xx})  # fmt: skip
            metrics = {url: _metrics(url) for url in urls}
    return {"streams": args.burst, "duplicates": args.burst // 4, "runs": runs, "server_metrics": metrics}


# --- shared ------------------------------------------------------------------------------------------
def _metrics(url: str) -> dict[str, float]:
    """The store's and takeover counters from a server's /metrics (non-zero samples)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found = {}
    names = "|".join(STORE_METRICS)
    for name, value in re.findall(rf"^((?:{names})\S*) (\S+)$", text, re.M):
        if float(value):
            found[name] = float(value)
    return found


def _summary(part: dict[str, Any]) -> dict[str, Any]:
    if "levels" in part:
        return {
            str(level["streams"]): {key: level[key] for key in ("failed", "output_tok_s", "ttft_p50_ms")}
            for level in part["levels"]
        } | {"of_offline": part.get("of_offline"), "store": part["server_metrics"]}
    if "output_tok_s" in part:
        return part
    return {
        "non_2xx": [r["non_2xx"] for r in part["runs"]],
        "generations": [r["generations"] for r in part["runs"]],
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("procs", "ceiling", "replicas", "collect"), required=True)
    parser.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")], default=[512, 1024])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prompts-per-stream", type=int, default=3, help="requests per run: this x the level")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--api-processes", type=int, default=4)
    parser.add_argument("--burst", type=int, default=1024, help="replicas: streams with ids per run")
    parser.add_argument("--memory", type=float, default=None, help="replicas: each one's GPU memory share")
    parser.add_argument("--machine", default="")
    parser.add_argument("--out", default="bench/gpu-results/full-load")
    return parser


if __name__ == "__main__":
    sys.exit(main())
