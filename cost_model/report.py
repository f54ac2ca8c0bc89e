"""Render an Analysis as a rich table (default) or JSON (--json)."""

from __future__ import annotations

from typing import Any

import orjson
from rich.console import Console
from rich.table import Table

from cost_model.analysis import Analysis


def _money(x: float) -> str:
    return f"${x:,.2f}" if x >= 1 else f"${x:.6f}"


def _opt(x: float | int | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def results_table(an: Analysis) -> Table:
    table = Table(
        title=f"Cost at {an.workload.requests_per_day:,.0f} requests/day "
        f"({an.workload.arrival.value}), {an.workload.prompt_tokens} in / "
        f"{an.workload.output_tokens} out tokens",
        title_justify="left",
    )
    for col in (
        "entry",
        "mode",
        "billable s/day",
        "replicas@peak",
        "cold starts/day",
        "$/request",
        "$/M out tok",
        "$/month",
    ):
        table.add_column(col, justify="left" if col in ("entry", "mode") else "right")
    for r in sorted(an.results, key=lambda r: r.cost_per_day):
        table.add_row(
            r.entry_id,
            r.mode,
            _opt(r.billable_seconds_per_day, ",.0f"),
            _opt(r.replicas_at_peak, "d"),
            _opt(r.cold_starts_per_day, ",.1f"),
            _money(r.cost_per_request),
            _money(r.cost_per_million_output),
            _money(r.cost_per_month),
        )
    return table


def render_text(an: Analysis, console: Console) -> None:
    for note in an.notes:
        console.print(note, highlight=False)
    console.print(f"service: {an.service.label}; cold start {an.service.cold_start_s:g} s", highlight=False)
    console.print(results_table(an))
    console.print("[bold]Working[/bold]")
    for r in sorted(an.results, key=lambda r: r.cost_per_day):
        for line in r.working:
            console.print(f"  {r.entry_id}: {line}", highlight=False)
    console.print("[bold]Break-even rates between the cheapest entry of each mode[/bold]")
    if not an.break_evens:
        console.print("  none between 10 and 10,000,000 requests/day", highlight=False)
    for be in an.break_evens:
        kind = "" if be.continuous else " (a replica step, not a smooth crossing)"
        console.print(
            f"  {be.a} = {be.b} at {be.requests_per_day:,.0f} requests/day, "
            f"{_money(be.monthly_cost)}/month{kind}",
            highlight=False,
        )
    if an.advice:
        console.print(f"[bold]Advice for {an.advice_for}[/bold]")
        for tip in an.advice:
            console.print(f"  {tip.setting}: {tip.value} - {tip.reason}", highlight=False)


def to_dict(an: Analysis) -> dict[str, Any]:
    return {
        "workload": an.workload.model_dump(mode="json"),
        "service": {
            "label": an.service.label,
            "cold_start_s": an.service.cold_start_s,
            "points": [p.model_dump() for p in an.service.points],
        },
        "results": [
            {
                "entry": r.entry_id,
                "platform": r.platform,
                "mode": r.mode,
                "billable_seconds_per_day": r.billable_seconds_per_day,
                "replicas_at_peak": r.replicas_at_peak,
                "cold_starts_per_day": r.cold_starts_per_day,
                "cost_per_request": r.cost_per_request,
                "cost_per_million_output_tokens": r.cost_per_million_output,
                "cost_per_day": r.cost_per_day,
                "cost_per_month": r.cost_per_month,
                "working": list(r.working),
            }
            for r in an.results
        ],
        "break_evens": [be.__dict__ for be in an.break_evens],
        "advice": {"entry": an.advice_for, "items": [t.__dict__ for t in an.advice]},
        "notes": an.notes,
    }


def render_json(an: Analysis) -> str:
    return orjson.dumps(to_dict(an), option=orjson.OPT_INDENT_2).decode()
