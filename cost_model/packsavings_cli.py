"""`python -m cost_model pack-savings`: its flags, and turning them into a Savings table."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console

from cost_model import catalogue as catmod
from cost_model.benchfile import load_bench
from cost_model.billing import Overrides
from cost_model.coldboot import TARGETS, choose_file, load_coldboot
from cost_model.errors import CostModelError
from cost_model.limits import integer, number
from cost_model.packsavings import (
    COG_CONCURRENCY,
    DEFAULT_ENTRY,
    DEFAULT_LEVELS,
    pack_savings,
    render_text,
    to_dict,
)

H200_BENCH = Path(__file__).resolve().parent.parent / "results" / "h200" / "bench.json"
MAX_LEVELS = 8


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "pack-savings",
        help="what a compile-cache pack saves per month on Replicate, at a few traffic levels",
        description="Simulate a day of requests at each level twice, with the measured empty-container "
        "start and the measured start from a compile-cache pack, and price both on a per-second entry.",
    )
    p.add_argument(
        "--coldboot",
        type=Path,
        metavar="FILE",
        help="cold-boot JSON (bundle-coldboot/1; default results/h200/coldboot/coldboot.json when present)",
    )
    p.add_argument(
        "--target", choices=TARGETS, default="cog", help="which boots: the Cog runner (default) or serve"
    )
    p.add_argument(
        "--entry", default=DEFAULT_ENTRY, help=f"per-second catalogue entry (default {DEFAULT_ENTRY})"
    )
    p.add_argument(
        "--levels", default=",".join(f"{x:g}" for x in DEFAULT_LEVELS), help="requests per day, comma-separated"
    )
    p.add_argument("--bench", type=Path, help="speed: benchmark JSON (default results/h200/bench.json)")
    p.add_argument(
        "--concurrency", type=integer("concurrency"), default=COG_CONCURRENCY, help="streams per container"
    )
    p.add_argument(
        "--scaledown-window", type=number("scaledown-window"), help="idle seconds (platform default)"
    )
    p.add_argument("--prompt-tokens", type=integer("prompt-tokens"), default=200)
    p.add_argument("--output-tokens", type=integer("output-tokens"), default=500)
    p.add_argument("--seed", type=integer("seed"), default=17)
    p.add_argument("--json", action="store_true", help="print JSON (schema cost-pack-savings/1)")


def levels(text: str) -> tuple[float, ...]:
    try:
        found = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise CostModelError(f"--levels wants requests per day separated by commas, got '{text}'") from None
    lo, hi = 1.0, 1e7
    if not found or len(found) > MAX_LEVELS or not all(lo <= x <= hi for x in found):
        raise CostModelError(f"--levels: 1 to {MAX_LEVELS} rates, each within {lo:g}..{hi:g} requests/day")
    return found


def run(args: argparse.Namespace, console: Console) -> None:
    rates = levels(args.levels)
    boots = load_coldboot(choose_file(args.coldboot))
    service, _ = load_bench(args.bench or H200_BENCH)
    overrides = Overrides(concurrency=args.concurrency, window_s=args.scaledown_window, seed=args.seed)
    workload = {"prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens}
    cat = catmod.load_packaged()
    result = pack_savings(boots, args.target, service, cat, args.entry, overrides, rates, workload)
    if args.json:
        inputs = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "command"}
        print(json.dumps(to_dict(result, inputs), indent=2))
    else:
        render_text(result, console)
