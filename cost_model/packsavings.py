"""What a compile-cache pack saves on Replicate's per-second billing, at a few traffic levels.

    python -m cost_model pack-savings [--coldboot FILE] [--entry replicate-gpu-h100] [--json]

Each level is one simulated day (cost_model/simulate.py) of Poisson requests on the Cog runner
(32 predictions per container, cog.yaml's concurrency), run twice on the same seed: once with
the measured empty-container start, once with the measured start from a pack. Replicate's
private models and deployments bill setup + idle + active, so every cold start is paid in GPU
seconds; public models bill active time only, where the pack changes what users wait, not the
bill (it can even raise it a little: fewer requests queue behind a shorter start and then share
an instance's active seconds; docs/cost-model.md). Only measured start-ups are used
(cost_model/coldboot.py), and the output names the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from cost_model.billing import ModeResult, Overrides
from cost_model.catalogue import Catalogue, PerSecondEntry
from cost_model.coldboot import ColdBoots
from cost_model.errors import CostModelError
from cost_model.serverless import simulated_per_second
from cost_model.service import ServiceProfile
from cost_model.workload import Workload

SCHEMA = "cost-pack-savings/1"
DEFAULT_ENTRY = "replicate-gpu-h100"
DEFAULT_LEVELS = (100.0, 1_000.0, 10_000.0)  # requests per day: rare, steady, busy
COG_CONCURRENCY = 32  # cog.yaml's concurrency.max = @cog.concurrent(max=32) in cog/predict.py


@dataclass(frozen=True)
class Level:
    requests_per_day: float
    empty: ModeResult
    pack: ModeResult

    @property
    def saved_per_month(self) -> float:
        return self.empty.cost_per_month - self.pack.cost_per_month


@dataclass(frozen=True)
class Savings:
    origin: str
    target: str
    empty_s: float
    pack_s: float
    entry: PerSecondEntry
    levels: tuple[Level, ...]


def pack_savings(
    boots: ColdBoots,
    target: str,
    service: ServiceProfile,
    cat: Catalogue,
    entry_id: str,
    overrides: Overrides,
    levels: tuple[float, ...],
    workload: dict[str, Any],
) -> Savings:
    empty_s, pack_s = boots.empty_and_pack(target)
    entry = cat.entry(entry_id)
    if not isinstance(entry, PerSecondEntry):
        raise CostModelError(f"--entry {entry_id} is not billed per second (kind {entry.kind})")
    rules = cat.rules_for(entry)
    rows = []
    for rate in levels:
        day = Workload(requests_per_day=rate, **workload)
        empty, pack = (
            simulated_per_second(entry, rules, day, _started_in(service, seconds, boots.origin), overrides)
            for seconds in (empty_s, pack_s)
        )
        rows.append(Level(rate, empty, pack))
    return Savings(boots.origin, target, empty_s, pack_s, entry, tuple(rows))


def _started_in(service: ServiceProfile, seconds: float, origin: str) -> ServiceProfile:
    return service.model_copy(update={"cold_start_s": seconds, "cold_start_source": origin})


def render_text(s: Savings, console: Console) -> None:
    console.print(
        f"start-up ({s.target}, from {s.origin}): empty container {s.empty_s:g} s, "
        f"with the pack {s.pack_s:g} s; priced on {s.entry.id} (${s.entry.usd_per_second}/s, {s.entry.source})"
    )
    table = Table(title="what the compile-cache pack saves per month")
    for column in (
        "requests/day",
        "starts/day",
        "waited on start",
        "$/month empty",
        "$/month pack",
        "saved/month",
    ):
        table.add_column(column, justify="right")
    for level in s.levels:
        table.add_row(
            f"{level.requests_per_day:,.0f}",
            f"{level.empty.cold_starts_per_day or 0:,.1f} -> {level.pack.cold_starts_per_day or 0:,.1f}",
            f"{level.empty.waited_share or 0:.1%} -> {level.pack.waited_share or 0:.1%}",
            f"${level.empty.cost_per_month:,.2f}",
            f"${level.pack.cost_per_month:,.2f}",
            f"${level.saved_per_month:,.2f} ({_share(level):.0%})",
        )
    console.print(table)


def _share(level: Level) -> float:
    return level.saved_per_month / level.empty.cost_per_month if level.empty.cost_per_month else 0.0


def to_dict(s: Savings, inputs: dict[str, Any]) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "coldboot_file": s.origin,
        "target": s.target,
        "startup_s": {"empty": s.empty_s, "pack": s.pack_s},
        "entry": {"id": s.entry.id, "usd_per_second": s.entry.usd_per_second, "source": s.entry.source},
        "inputs": inputs,
        "levels": [
            {
                "requests_per_day": level.requests_per_day,
                "cold_starts_per_day": {
                    "empty": level.empty.cold_starts_per_day,
                    "pack": level.pack.cold_starts_per_day,
                },
                "waited_share": {"empty": level.empty.waited_share, "pack": level.pack.waited_share},
                "usd_per_month": {"empty": level.empty.cost_per_month, "pack": level.pack.cost_per_month},
                "saved_usd_per_month": level.saved_per_month,
            }
            for level in s.levels
        ],
    }
