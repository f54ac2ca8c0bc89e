"""`python -m bench`: run the benchmark.

    python -m bench suite --out results/cpu     # what `make bench` runs
    python -m bench http --url http://127.0.0.1:8000
    python -m bench startup ...                   # start-up benchmark (bench/startup.py)
    python -m bench redis --levels 1,8,32,128     # cost of BUNDLE_REDIS_URL (bench/redis_overhead.py)
    python -m bench timelines OUT/timelines.json --against raw   # TTFT by wave (bench/timelines.py)

Engine settings come from the usual BUNDLE_* variables (the tiny CPU model by default; on a
GPU e.g. BUNDLE_TINY_MODEL_SHAPE=llama3-8b BUNDLE_LOAD_FORMAT=dummy).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import sys
from pathlib import Path

from bench.specs import KINDS
from bench.workload import Workload


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["redis"]:  # the shared identity store's overhead (bench/redis_overhead.py)
        from bench.redis_overhead import main as redis_main

        return redis_main(argv[1:])
    if argv[:1] == ["lora"]:  # streams spread over LoRA adapters against the base (bench/lora.py)
        from bench.lora import main as lora_main

        return lora_main(argv[1:])
    if argv[:1] == ["timelines"]:
        from bench.timelines import main as timelines_main

        return timelines_main(argv[1:])
    if argv[:1] == ["stepped"]:  # the serving layer's own CPU per token (bench/stepped.py)
        from bench.stepped import main as stepped_main

        return stepped_main(argv[1:])
    if argv[:1] == ["merge"]:  # python -m bench merge OUT_DIR A/bench.json B/bench.json ...
        return run_merge(argv[1:])
    if argv[:1] == ["startup"]:
        # Its own arguments, parsed by its own main: everything after the word goes there.
        return run_startup(argv[1:])
    args = parser().parse_args(argv)
    if args.command == "suite":
        from bench.specs import BadTarget, TargetSpec
        from bench.suite import merge_refusal, run_suite

        try:
            [TargetSpec.parse(name) for name in args.targets.split(",")]
        except BadTarget as exc:
            print(f"python -m bench suite: {exc}", file=sys.stderr)
            return 2
        refusal = merge_refusal(Path(args.out)) if args.merge else None
        if refusal:
            print(f"python -m bench suite: {refusal}", file=sys.stderr)
            return 2
        run_suite(args)
        return 0
    from bench.targets import bench_http

    workload = Workload(
        args.prompt_tokens,
        args.output_tokens,
        args.vocab,
        seed=args.seed,
        model=args.model,
        shared_prefix_tokens=args.shared_prefix_tokens,
        request_rate=args.request_rate,
        think_s=args.think_time,
        think_random=args.think_random,
        output_spread=args.output_spread,
    )
    levels = [int(x) for x in args.levels.split(",")]
    asyncio.run(bench_http(args.url, workload, levels, args.rounds, args.api_key, args.clients, args.repeat))
    return 0


def run_merge(argv: list[str]) -> int:
    """Several runs' bench.json (a pair of GPUs, say) -> one bench.json/.md/.png in OUT_DIR."""
    from bench.suite import merge_reports, write_report

    if len(argv) < 2:
        print("usage: python -m bench merge OUT_DIR REPORT.json [REPORT.json ...]", file=sys.stderr)
        return 2
    try:
        report = merge_reports([Path(name) for name in argv[1:]])
    except (OSError, ValueError, KeyError) as exc:
        print(f"python -m bench merge: {exc}", file=sys.stderr)
        return 2
    write_report(report, Path(argv[0]))
    return 0


def run_startup(argv: list[str]) -> int:
    """Hand over to `bench.startup.main`, imported only when asked for (it may be absent)."""
    try:
        startup = importlib.import_module("bench.startup")
    except ModuleNotFoundError as exc:
        if exc.name != "bench.startup":
            raise
        print("python -m bench startup: bench/startup.py is not in this checkout", file=sys.stderr)
        return 2
    return int(startup.main(argv))


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = top.add_subparsers(dest="command", required=True)
    for name in ("suite", "http"):
        _load_arguments(sub.add_parser(name))
    sub.add_parser("startup", help="start-up benchmark; its arguments: python -m bench startup --help")
    suite = sub.choices["suite"]
    suite.add_argument("--out", default="results/cpu")
    suite.add_argument(
        "--targets", default=",".join(KINDS), help="raw, bundle, vllm_server; KIND:PRESET; vllm_server:defaults"
    )
    suite.add_argument(
        "--prefix-caching",
        type=_on_off_list,
        default=[True],
        help="on, off or on,off: each target once per mode, the flag passed explicitly to all (default on)",
    )
    suite.add_argument("--capacity", type=int, default=1000, help="streams held open; 0: skip")
    suite.add_argument("--machine", default="", help="how to name the machine in the report")
    suite.add_argument("--merge", action="store_true", help="add to the targets in --out/bench.json")
    http = sub.choices["http"]
    http.add_argument("--url", required=True)
    http.add_argument("--model", default="tiny")
    http.add_argument("--api-key")
    return top


def _load_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--levels", default="1,8,32,128", help="concurrency levels")
    p.add_argument("--rounds", type=int, default=2, help="requests per level = level x rounds, at least 16")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--vocab", type=int, default=1000, help="prompt ids are drawn below this")
    p.add_argument("--repeat", type=int, default=3, help="runs per level; the median run is reported")
    p.add_argument("--seed", type=int, default=0, help="prompts are a function of this and the batch")
    p.add_argument(
        "--request-rate",
        type=_positive_rate,
        default=None,
        help="open loop: requests start as a Poisson process at this many per second, a level "
        "only caps how many are in flight (default: closed loop, each level's requests at once, "
        "then one as each ends)",
    )
    p.add_argument(
        "--think-time",
        type=_think_time,
        default=0.0,
        help="seconds a client holds its place after a response ends before its next request "
        "(a user's think time; default 0)",
    )
    p.add_argument(
        "--think-random",
        action="store_true",
        help="draw each request's think time from an exponential distribution with --think-time "
        "as its mean (seeded by the request: the same for every target)",
    )
    p.add_argument(
        "--output-spread",
        type=_output_spread,
        default=0.0,
        help="each request's output length drawn uniformly within this share either side of "
        "--output-tokens, seeded by the request (the same for every target); default 0, all equal",
    )
    p.add_argument(
        "--shared-prefix-tokens",
        type=int,
        default=0,
        help="a common prefix of this many tokens before each prompt's unique --prompt-tokens",
    )
    p.add_argument(
        "--clients",
        type=int,
        default=1 if (os.cpu_count() or 1) <= 4 else 4,
        help="client processes for HTTP targets (default: 4 on machines with >4 CPUs)",
    )


def _on_off_list(text: str) -> list[bool]:
    modes = {"on": True, "off": False}
    words = [word.strip() for word in text.split(",")]
    if not words or any(word not in modes for word in words):
        raise argparse.ArgumentTypeError(f"expected on, off or on,off, not {text!r}")
    return [modes[word] for word in words]


def _positive_rate(text: str) -> float:
    rate = _number(text)
    if not 0 < rate < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of requests per second: {text!r}")
    return rate


def _think_time(text: str) -> float:
    seconds = _number(text)
    if not 0 <= seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"must be zero or a positive number of seconds: {text!r}")
    return seconds


def _output_spread(text: str) -> float:
    share = _number(text)
    if not 0 <= share < 1:
        raise argparse.ArgumentTypeError(f"must be at least 0 and below 1 (of --output-tokens): {text!r}")
    return share


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


if __name__ == "__main__":
    raise SystemExit(main())
