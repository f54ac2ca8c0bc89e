"""Command-line interface: argument parsing and turning flags into model inputs."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from rich.console import Console

from cost_model import catalogue as catmod
from cost_model import packsavings_cli
from cost_model.advice import DEFAULT_P95_TTFT_S
from cost_model.analysis import analyse
from cost_model.billing import Overrides
from cost_model.catalogue import Catalogue, Entry
from cost_model.errors import CostModelError
from cost_model.finetunes import DEFAULT_LORA_OVERHEAD, LoraPlan
from cost_model.limits import BOUNDS, OneLineParser, integer, number
from cost_model.profile import build_service
from cost_model.report import render_json, render_text
from cost_model.scenarios import SCENARIOS, notes_for, scenario
from cost_model.startup import DEFAULT_SNAPSHOT_RESTORE_S, SNAPSHOT_RESTORE_SOURCE
from cost_model.workload import Workload

DESCRIPTION = """\
Estimate what serving an LLM really costs under each billing mode.

A request's bill is not its duration times a rate. Per-second serverless platforms
(Modal, Replicate private models, RunPod flex) bill container uptime: start-up after a
cold start, idle time inside the scale-down window, minimum containers kept warm, and
extra replicas at peak. Streams that share a GPU split its seconds. Per-token APIs,
per-request prices and reserved hourly machines are billed differently again. This tool
models all four and shows its working.
"""

EPILOG = """\
examples:
  python -m cost_model estimate --scenario seed
  python -m cost_model estimate --requests-per-day 20000 --arrival peak --peak-factor 4 \\
      --tokens-per-s 60 --ttft 0.3 --cold-start 40 --gpu L40S --concurrency 16
  python -m cost_model estimate --bench bench.json --requests-per-hour 500 --json
  python -m cost_model estimate --scenario seed --plot cost.png
  python -m cost_model catalogue            # list priced entries and their sources
  python -m cost_model sweep-bench          # time 200 rates x every catalogue entry
  python -m cost_model pack-savings         # what a compile-cache pack saves on Replicate
"""


def _workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    rate = g.add_mutually_exclusive_group()
    rate.add_argument("--requests-per-day", type=number("requests-per-day"), help="mean request rate per day")
    rate.add_argument(
        "--requests-per-hour", type=number("requests-per-hour"), help="mean request rate per hour"
    )
    g.add_argument(
        "--arrival",
        choices=["steady", "poisson", "peak"],
        help="steady: even spacing; poisson: random (default); peak: Poisson with a daily peak",
    )
    g.add_argument("--peak-factor", type=number("peak-factor"), help="peak rate / mean rate (default 3)")
    g.add_argument("--peak-hours", type=number("peak-hours"), help="hours per day at the peak rate (default 4)")
    g.add_argument(
        "--prompt-tokens", type=integer("prompt-tokens"), help="input tokens per request (default 200)"
    )
    g.add_argument(
        "--output-tokens", type=integer("output-tokens"), help="output tokens per request (default 500)"
    )


def _service_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("service (measured speed of one replica)")
    g.add_argument("--bench", type=Path, help="benchmark JSON (schema bundle-bench/1); uses targets.bundle")
    g.add_argument("--tokens-per-s", type=number("tokens-per-s"), help="per-stream decode rate at one stream")
    g.add_argument(
        "--assume-flat-speed",
        action="store_true",
        help="let a single --tokens-per-s point stand for every stream when concurrency > 1 (optimistic)",
    )
    g.add_argument("--throughput", help="per-stream rate by concurrency, e.g. 1:500,8:400,32:250")
    g.add_argument(
        "--ttft", type=number("ttft"), help="time to first token at a zero-token prompt (default 0.2)"
    )
    g.add_argument(
        "--prefill-tokens-per-s",
        type=number("prefill-tokens-per-s"),
        help="prompt tokens per second added to TTFT (default: from --bench, else 10,000, an assumption)",
    )
    s = p.add_argument_group(
        "start-up (never silently 0)",
        "Start-up seconds come from --cold-start, else --startup FILE, else the benchmark JSON's "
        "cold_start_s, else a stated default (38 s: the bundle's warm-compile-cache H200 start). "
        "FILE is the start-up benchmark's JSON (schema bundle-startup/1, e.g. results/h200/startup.json "
        "from `python -m bench startup`): its paths.<name>.first_token_s.median is used.",
    )
    s.add_argument("--cold-start", type=number("cold-start"), help="seconds from cold container to first token")
    s.add_argument("--startup", type=Path, metavar="FILE", help="start-up benchmark JSON (bundle-startup/1)")
    s.add_argument(
        "--startup-path",
        metavar="NAME",
        help="path in FILE for cold starts: empty-cache, warm-cache or eager "
        "(default: the fastest non-snapshot)",
    )
    s.add_argument(
        "--snapshot-restore-s",
        type=number("snapshot-restore-s"),
        default=DEFAULT_SNAPSHOT_RESTORE_S,
        help=f"platform restore time added to FILE's 'wake' path (default {DEFAULT_SNAPSHOT_RESTORE_S:g} s: "
        f"{SNAPSHOT_RESTORE_SOURCE})",
    )


def _platform_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("platform and prices")
    g.add_argument(
        "--gpu", help="GPU class to price (default A100-80GB); warned when it differs from the bench's"
    )
    g.add_argument(
        "--model-params-b",
        type=number("model-params-b"),
        default=8.0,
        help="served model size, billions of parameters: picks per-token rows priced for it (default 8)",
    )
    g.add_argument("--entries", help="comma-separated catalogue ids to compare (overrides --gpu selection)")
    g.add_argument(
        "--catalogue",
        type=Path,
        help="JSON file whose platforms/entries replace or extend the catalogue",
    )
    g.add_argument("--price-per-second", type=number("price-per-second"), help="add custom-per-second at USD/s")
    g.add_argument("--platform", default="modal", help="billing rules for custom-per-second (default modal)")
    g.add_argument("--price-per-hour", type=number("price-per-hour"), help="add custom-reserved at USD/hour")
    g.add_argument(
        "--price-per-request", type=number("price-per-request"), help="add custom-per-request at USD"
    )
    g.add_argument("--price-per-million-tokens", help="add entry custom-per-token: IN,OUT USD per million")
    g.add_argument(
        "--concurrency", type=integer("concurrency"), help="max streams per replica (platform default 1)"
    )
    g.add_argument("--scaledown-window", type=number("scaledown-window"), help="idle seconds before scale-down")
    g.add_argument(
        "--min-containers", type=integer("min-containers"), help="replicas kept up all day (default 0)"
    )
    g.add_argument(
        "--max-containers", type=integer("max-containers"), default=1000, help="replica limit (default 1000)"
    )
    g.add_argument(
        "--billed",
        help="what serverless bills, e.g. active or setup,idle,active (platform default)",
    )
    g.add_argument(
        "--cpu-cores",
        type=number("cpu-cores"),
        default=1.0,
        help="CPU cores reserved per replica (Modal; default 1)",
    )
    g.add_argument(
        "--memory-gib", type=number("memory-gib"), default=16.0, help="memory GiB per replica (default 16)"
    )
    g.add_argument(
        "--p95-ttft-s",
        type=number("p95-ttft-s"),
        default=DEFAULT_P95_TTFT_S,
        help=f"latency target for the advice: p95 time to first token (default {DEFAULT_P95_TTFT_S:g} s)",
    )
    g.add_argument("--seed", type=integer("seed"), default=17, help="simulation seed (default 17)")


def _fine_tune_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "fine-tunes (LoRA)",
        "Price N fine-tunes of the model two ways: one deployment serving them all as LoRA adapters "
        "(the sum of the traffic, one set of start-ups, idle windows and minimum containers) against N "
        "deployments, each with 1/N of the traffic and its own. The request rate is the total.",
    )
    g.add_argument("--fine-tunes", type=integer("fine-tunes"), metavar="N", help="number of fine-tunes")
    g.add_argument(
        "--lora-overhead",
        type=number("lora-overhead"),
        metavar="F",
        help="extra time per token when serving adapters, 0.1 = 10%% slower "
        f"(default {DEFAULT_LORA_OVERHEAD:g}: 64 streams over 4 rank-16 adapters on the H200; give yours)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="python -m cost_model",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    est = sub.add_parser(
        "estimate",
        help="cost of a workload under every billing mode",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    est.add_argument("--scenario", choices=sorted(SCENARIOS), help="fill unset flags from a named example")
    _workload_args(est)
    _service_args(est)
    _platform_args(est)
    _fine_tune_args(est)
    out = est.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print JSON instead of a table")
    out.add_argument("--plot", type=Path, metavar="FILE.png", help="also draw $/month against request rate")
    cat = sub.add_parser("catalogue", help="list the price catalogue with sources")
    cat.add_argument("--catalogue", type=Path, help="override file to merge first")
    sub.add_parser("sweep-bench", help="time a 200-rate sweep over every catalogue entry")
    packsavings_cli.add_parser(sub)
    return parser


def _fill(args: argparse.Namespace) -> dict[str, Any]:
    """Flags the user gave win over the scenario, which wins over built-in defaults."""
    defaults = {
        "arrival": "poisson",
        "peak_factor": 3.0,
        "peak_hours": 4.0,
        "prompt_tokens": 200,
        "output_tokens": 500,
        "ttft": 0.2,
        "gpu": "A100-80GB",
    }
    merged = {**defaults, **scenario(args.scenario)}
    if args.scenario and "cold_start" in merged:
        merged["_cold_source"] = f"the {args.scenario} scenario's figure"
    merged.update({k: v for k, v in vars(args).items() if v is not None})
    if args.requests_per_hour is not None:
        merged["requests_per_day"] = args.requests_per_hour * 24
    return merged


def make_workload(v: dict[str, Any]) -> Workload:
    if v.get("requests_per_day") is None:
        raise CostModelError("give the request rate: --requests-per-day N or --requests-per-hour N")
    if v["requests_per_day"] <= 0:
        raise CostModelError(f"request rate must be > 0, got {v['requests_per_day']:g}/day")
    fields = (
        "requests_per_day",
        "arrival",
        "peak_factor",
        "peak_hours",
        "prompt_tokens",
        "output_tokens",
    )
    return Workload(**{f: v[f] for f in fields})


def _billed(text: str | None) -> tuple[bool | None, bool | None]:
    if text is None:
        return None, None
    parts = {p.strip() for p in text.split(",") if p.strip()}
    if not parts <= {"setup", "idle", "active"} or "active" not in parts:
        raise CostModelError(f"--billed must list active plus any of setup, idle; got '{text}'")
    return "setup" in parts, "idle" in parts


def make_overrides(v: dict[str, Any]) -> Overrides:
    if (v.get("min_containers") or 0) > v["max_containers"]:
        raise CostModelError(
            f"--min-containers {v['min_containers']} exceeds --max-containers {v['max_containers']}"
        )
    setup, idle = _billed(v.get("billed"))
    return Overrides(
        concurrency=v.get("concurrency"),
        window_s=v.get("scaledown_window"),
        min_containers=v.get("min_containers"),
        bills_setup=setup,
        bills_idle=idle,
        cpu_cores=v["cpu_cores"],
        memory_gib=v["memory_gib"],
        max_containers=v["max_containers"],
        seed=v["seed"],
    )


def _custom_entries(v: dict[str, Any]) -> list[dict[str, Any]]:
    base = {"source": "command line", "read_on": "2026-11-29"}
    out = []
    if v.get("price_per_second") is not None:
        out.append(
            {
                **base,
                "id": "custom-per-second",
                "platform": v["platform"],
                "kind": "per_second",
                "gpu": v["gpu"],
                "usd_per_second": v["price_per_second"],
            }
        )
    if v.get("price_per_hour") is not None:
        out.append(
            {
                **base,
                "id": "custom-reserved",
                "platform": "command-line",
                "kind": "reserved_hourly",
                "gpu": v["gpu"],
                "usd_per_hour": v["price_per_hour"],
            }
        )
    if v.get("price_per_request") is not None:
        out.append(
            {
                **base,
                "id": "custom-per-request",
                "platform": "command-line",
                "kind": "per_request",
                "usd_per_request": v["price_per_request"],
            }
        )
    if v.get("price_per_million_tokens") is not None:
        try:
            tin, tout = (float(x) for x in v["price_per_million_tokens"].split(","))
        except ValueError:
            raise CostModelError("--price-per-million-tokens wants IN,OUT, e.g. 0.05,0.25") from None
        if not all(math.isfinite(x) and 0 <= x <= 1000 for x in (tin, tout)):
            raise CostModelError("--price-per-million-tokens values must be finite and within 0..1000 USD")
        out.append(
            {
                **base,
                "id": "custom-per-token",
                "platform": "command-line",
                "kind": "per_token",
                "usd_per_million_input": tin,
                "usd_per_million_output": tout,
            }
        )
    return out


def make_catalogue(v: dict[str, Any]) -> tuple[Catalogue, list[str]]:
    cat = catmod.load_packaged()
    if v.get("catalogue") is not None:
        cat = catmod.load_override(v["catalogue"], cat)
    custom = _custom_entries(v)
    if v["platform"] not in cat.platforms:
        raise CostModelError(
            f"unknown --platform '{v['platform']}' (known: {', '.join(sorted(cat.platforms))})"
        )
    for raw in custom:
        cat = catmod.add_entry(cat, raw)
    return cat, [raw["id"] for raw in custom]


# Each GPU row is simulated (up to ~0.3 s, more with the advice and --fine-tunes); the packaged
# catalogue selects about a dozen rows for one GPU, so 100 leaves room for a user's own catalogue while
# an estimate still ends in about a minute, not hours.
MAX_ROWS = 100


def select_entries(cat: Catalogue, v: dict[str, Any], custom_ids: list[str]) -> list[Entry]:
    chosen = _choose(cat, v, custom_ids)
    if len(chosen) > MAX_ROWS:
        raise CostModelError(f"{len(chosen)} entries selected, at most {MAX_ROWS}: narrow them with --entries")
    return chosen


def _choose(cat: Catalogue, v: dict[str, Any], custom_ids: list[str]) -> list[Entry]:
    if v.get("entries") is not None:  # "" is a list of no entries (refused), not "every entry"
        return cat.pick(v["entries"])
    if v["gpu"] not in cat.gpus():
        raise CostModelError(f"unknown GPU '{v['gpu']}' (known: {', '.join(cat.gpus())})")
    size = v["model_params_b"]

    def fits(e: Entry) -> bool:
        # A per-token price is for one model size: keep rows for this size up to a 2x larger tier.
        params = getattr(e, "model_params_b", None)
        return params is None or size <= params <= 2 * size

    return [
        e
        for e in cat.entries
        if (e.kind in catmod.GPU_KINDS and e.gpu == v["gpu"])  # type: ignore[union-attr]
        or (e.kind == "per_token" and fits(e))
        or e.kind == "per_request"
        or e.id in custom_ids
    ]


def _lora_plan(v: dict[str, Any], w: Workload) -> LoraPlan | None:
    if v.get("fine_tunes") is None:
        if v.get("lora_overhead") is not None:
            raise CostModelError("--lora-overhead needs --fine-tunes N")
        return None
    each, floor = w.requests_per_day / v["fine_tunes"], BOUNDS["requests-per-day"][0]
    if each < floor:  # the same floor as one deployment's rate: below it the simulation sees no request
        raise CostModelError(
            f"--fine-tunes {v['fine_tunes']} leaves {each:.3g} requests/day per deployment, below {floor:g}"
        )
    overhead = v.get("lora_overhead")
    return LoraPlan(v["fine_tunes"], DEFAULT_LORA_OVERHEAD if overhead is None else overhead)


def check_options(v: dict[str, Any]) -> None:
    """What no other step checks before the computing starts."""
    if v.get("startup_path") is not None and v.get("startup") is None:
        raise CostModelError("--startup-path needs --startup FILE")
    if v.get("plot") is not None:
        from cost_model.plot import check_plot_path

        check_plot_path(v["plot"])


def run_estimate(args: argparse.Namespace, console: Console) -> None:
    v = _fill(args)
    if args.cold_start is not None:
        v["_cold_source"] = "--cold-start"
    check_options(v)
    workload = make_workload(v)
    lora = _lora_plan(v, workload)
    service, service_notes, snapshot = build_service(v)
    overrides = make_overrides(v)
    cat, custom_ids = make_catalogue(v)
    entries = select_entries(cat, v, custom_ids)
    notes = notes_for(args.scenario) + service_notes
    an = analyse(
        cat,
        entries,
        workload,
        service,
        overrides,
        notes,
        v["p95_ttft_s"],
        bool(v.get("assume_flat_speed")),
        snapshot,
        lora,
    )
    if args.json:
        print(render_json(an, inputs_used(v), cat))
    else:
        render_text(an, console)
    if args.plot is not None:
        from cost_model.plot import write_plot

        write_plot(args.plot, cat, entries, an)


def _price_text(entry: Any) -> str:
    if entry.kind == "per_second":
        pinned = entry.usd_per_second_min_container
        return f"${entry.usd_per_second}/s" + (f" (min containers ${pinned}/s)" if pinned else "")
    if entry.kind == "reserved_hourly":
        return f"${entry.usd_per_hour}/h"
    if entry.kind == "per_token":
        return f"${entry.usd_per_million_input}/${entry.usd_per_million_output} per M"
    return f"${entry.usd_per_request}/req"


def _model_text(e: Any) -> str:
    params = getattr(e, "model_params_b", None)
    return f"{getattr(e, 'model', '')}" + (f" [{params:g}B]" if params else "")


def run_catalogue(args: argparse.Namespace, console: Console) -> None:
    cat = catmod.load_packaged()
    if args.catalogue is not None:
        cat = catmod.load_override(args.catalogue, cat)
    from rich.table import Table

    table = Table(title="price catalogue")
    for col in ("id", "kind", "gpu/model", "price", "read on", "source", "note"):
        table.add_column(col, overflow="fold")
    for e in cat.entries:
        price = _price_text(e)
        table.add_row(
            e.id,
            e.kind,
            getattr(e, "gpu", None) or _model_text(e),
            price,
            e.read_on,
            e.source,
            e.note,
        )
    console.print(table)


def inputs_used(v: dict[str, Any]) -> dict[str, Any]:
    """Every input in force (flags, scenario, defaults), JSON-safe, for --json."""
    return {
        k: (str(x) if isinstance(x, Path) else x)
        for k, x in sorted(v.items())
        if not k.startswith("_") and k not in ("command", "json", "plot") and x is not None
    }


def one_line(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "input"
        return f"invalid {where}: {err['msg']}"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # bad flags: OneLineParser has printed the one line already
        if exc.code in (0, None):
            raise
        return 2
    # Wide enough for the table when piped to a file (rich falls back to 80 columns).
    console = Console() if sys.stdout.isatty() else Console(width=210)
    try:
        if args.command == "estimate":
            run_estimate(args, console)
        elif args.command == "catalogue":
            run_catalogue(args, console)
        elif args.command == "pack-savings":
            packsavings_cli.run(args, console)
        else:
            from cost_model.bench_sweep import main as sweep_main

            sweep_main()
    except (CostModelError, ValidationError, RecursionError, OverflowError) as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 2
    return 0
