"""Command-line interface: argument parsing and turning flags into model inputs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from rich.console import Console

from cost_model import catalogue as catmod
from cost_model.analysis import analyse
from cost_model.benchfile import load_bench
from cost_model.billing import Overrides
from cost_model.catalogue import Catalogue, Entry
from cost_model.errors import CostModelError
from cost_model.report import render_json, render_text
from cost_model.scenarios import SCENARIOS, notes_for, scenario
from cost_model.service import ServiceProfile, from_flags
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
"""


def _workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    rate = g.add_mutually_exclusive_group()
    rate.add_argument("--requests-per-day", type=float, help="mean request rate per day")
    rate.add_argument("--requests-per-hour", type=float, help="mean request rate per hour")
    g.add_argument(
        "--arrival",
        choices=["steady", "poisson", "peak"],
        help="steady: even spacing; poisson: random (default); peak: Poisson with a daily peak",
    )
    g.add_argument("--peak-factor", type=float, help="peak rate / mean rate (with --arrival peak; default 3)")
    g.add_argument("--peak-hours", type=float, help="hours per day at the peak rate (default 4)")
    g.add_argument("--prompt-tokens", type=int, help="input tokens per request (default 200)")
    g.add_argument("--output-tokens", type=int, help="output tokens per request (default 500)")


def _service_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("service (measured speed of one replica)")
    g.add_argument("--bench", type=Path, help="benchmark JSON (schema bundle-bench/1); uses targets.bundle")
    g.add_argument("--tokens-per-s", type=float, help="per-stream decode rate at one stream")
    g.add_argument("--throughput", help="per-stream rate by concurrency, e.g. 1:500,8:400,32:250")
    g.add_argument("--ttft", type=float, help="time to first token, seconds (default 0.2)")
    g.add_argument("--cold-start", type=float, help="seconds from cold container to ready (default 30)")


def _platform_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("platform and prices")
    g.add_argument("--gpu", help="GPU class the service speed was measured on (default A100-80GB)")
    g.add_argument("--entries", help="comma-separated catalogue ids to compare (overrides --gpu selection)")
    g.add_argument(
        "--catalogue",
        type=Path,
        help="JSON file whose platforms/entries replace or extend the catalogue",
    )
    g.add_argument("--price-per-second", type=float, help="add entry custom-per-second at this USD/s")
    g.add_argument("--platform", default="modal", help="billing rules for custom-per-second (default modal)")
    g.add_argument("--price-per-hour", type=float, help="add entry custom-reserved at this USD/hour")
    g.add_argument("--price-per-request", type=float, help="add entry custom-per-request at this USD")
    g.add_argument("--price-per-million-tokens", help="add entry custom-per-token: IN,OUT USD per million")
    g.add_argument("--concurrency", type=int, help="max concurrent streams per replica (platform default 1)")
    g.add_argument("--scaledown-window", type=float, help="seconds an idle replica stays up (platform default)")
    g.add_argument("--min-containers", type=int, help="replicas kept up all day (default 0)")
    g.add_argument(
        "--billed",
        help="what serverless bills, e.g. active or setup,idle,active (platform default)",
    )
    g.add_argument(
        "--cpu-cores",
        type=float,
        default=1.0,
        help="CPU cores reserved per replica (Modal; default 1)",
    )
    g.add_argument("--memory-gib", type=float, default=16.0, help="memory GiB per replica (Modal; default 16)")
    g.add_argument(
        "--max-cold-fraction",
        type=float,
        default=0.01,
        help="cold starts per request the advice tolerates (default 0.01)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
    out = est.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print JSON instead of a table")
    out.add_argument("--plot", type=Path, metavar="FILE.png", help="also draw $/month against request rate")
    cat = sub.add_parser("catalogue", help="list the price catalogue with sources")
    cat.add_argument("--catalogue", type=Path, help="override file to merge first")
    sub.add_parser("sweep-bench", help="time a 200-rate sweep over every catalogue entry")
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
        "cold_start": 30.0,
        "gpu": "A100-80GB",
    }
    merged = {**defaults, **scenario(args.scenario)}
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


def make_service(v: dict[str, Any]) -> ServiceProfile:
    if v.get("bench") is not None:
        cold = v["cold_start"] if "cold_start" in v and v.get("_cold_given") else None
        return load_bench(v["bench"], cold)
    return from_flags(v.get("tokens_per_s"), v.get("throughput"), v["ttft"], v["cold_start"])


def _billed(text: str | None) -> tuple[bool | None, bool | None]:
    if text is None:
        return None, None
    parts = {p.strip() for p in text.split(",") if p.strip()}
    if not parts <= {"setup", "idle", "active"} or "active" not in parts:
        raise CostModelError(f"--billed must list active plus any of setup, idle; got '{text}'")
    return "setup" in parts, "idle" in parts


def make_overrides(v: dict[str, Any]) -> Overrides:
    for name in ("concurrency", "min_containers"):
        if v.get(name) is not None and v[name] < (1 if name == "concurrency" else 0):
            raise CostModelError(f"--{name.replace('_', '-')} is out of range: {v[name]}")
    if v.get("scaledown_window") is not None and v["scaledown_window"] < 0:
        raise CostModelError("--scaledown-window must be >= 0 seconds")
    if v["cpu_cores"] < 0 or v["memory_gib"] < 0 or not 0 <= v["max_cold_fraction"] <= 1:
        raise CostModelError("--cpu-cores/--memory-gib must be >= 0 and --max-cold-fraction within 0..1")
    setup, idle = _billed(v.get("billed"))
    return Overrides(
        concurrency=v.get("concurrency"),
        window_s=v.get("scaledown_window"),
        min_containers=v.get("min_containers"),
        bills_setup=setup,
        bills_idle=idle,
        cpu_cores=v["cpu_cores"],
        memory_gib=v["memory_gib"],
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
    if custom and v["platform"] not in cat.platforms:
        raise CostModelError(
            f"unknown --platform '{v['platform']}' (known: {', '.join(sorted(cat.platforms))})"
        )
    for raw in custom:
        cat = catmod.add_entry(cat, raw)
    return cat, [raw["id"] for raw in custom]


def select_entries(cat: Catalogue, v: dict[str, Any], custom_ids: list[str]) -> list[Entry]:
    if v.get("entries"):
        return [cat.entry(e.strip()) for e in v["entries"].split(",") if e.strip()]
    if v["gpu"] not in cat.gpus():
        raise CostModelError(f"unknown GPU '{v['gpu']}' (known: {', '.join(cat.gpus())})")
    chosen = [
        e
        for e in cat.entries
        if (e.kind in catmod.GPU_KINDS and e.gpu == v["gpu"])  # type: ignore[union-attr]
        or e.kind in ("per_token", "per_request")
        or e.id in custom_ids
    ]
    return chosen


def run_estimate(args: argparse.Namespace, console: Console) -> None:
    v = _fill(args)
    v["_cold_given"] = args.cold_start is not None
    workload, service = make_workload(v), make_service(v)
    overrides = make_overrides(v)
    cat, custom_ids = make_catalogue(v)
    entries = select_entries(cat, v, custom_ids)
    an = analyse(cat, entries, workload, service, overrides, v["max_cold_fraction"], notes_for(args.scenario))
    if args.json:
        print(render_json(an))
    else:
        render_text(an, console)
    if args.plot is not None:
        from cost_model.plot import write_plot

        write_plot(args.plot, cat, entries, an)


def _price_text(entry: Any) -> str:
    if entry.kind == "per_second":
        return f"${entry.usd_per_second}/s"
    if entry.kind == "reserved_hourly":
        return f"${entry.usd_per_hour}/h"
    if entry.kind == "per_token":
        return f"${entry.usd_per_million_input}/${entry.usd_per_million_output} per M"
    return f"${entry.usd_per_request}/req"


def run_catalogue(args: argparse.Namespace, console: Console) -> None:
    cat = catmod.load_packaged()
    if args.catalogue is not None:
        cat = catmod.load_override(args.catalogue, cat)
    from rich.table import Table

    table = Table(title="price catalogue")
    for col in ("id", "kind", "gpu/model", "price", "read on", "source"):
        table.add_column(col, overflow="fold")
    for e in cat.entries:
        price = _price_text(e)
        table.add_row(
            e.id,
            e.kind,
            getattr(e, "gpu", None) or getattr(e, "model", ""),
            price,
            e.read_on,
            e.source,
        )
    console.print(table)


def one_line(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "input"
        return f"invalid {where}: {err['msg']}"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Wide enough for the table when piped to a file (rich falls back to 80 columns).
    console = Console() if sys.stdout.isatty() else Console(width=150)
    try:
        if args.command == "estimate":
            run_estimate(args, console)
        elif args.command == "catalogue":
            run_catalogue(args, console)
        else:
            from cost_model.bench_sweep import main as sweep_main

            sweep_main()
    except (CostModelError, ValidationError) as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 2
    return 0
