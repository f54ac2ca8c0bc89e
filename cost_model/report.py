"""Render an Analysis as a rich table (default) or JSON (--json)."""

from __future__ import annotations

from typing import Any

import orjson
from rich.console import Console
from rich.table import Table

from cost_model.analysis import Analysis
from cost_model.billing import ModeResult
from cost_model.catalogue import Catalogue
from cost_model.finetunes import FineTunes

JSON_SCHEMA = "cost-estimate/2"
COLUMNS = (
    "entry",
    "mode",
    "billed s/day",
    "peak ctrs",
    "starts/day",
    "waited on start",
    "TTFT p50/p95/p99 s",
    "e2e p50/p95/p99 s",
    "$/request",
    "$/M out tok",
    "$/month",
)


def _money(x: float) -> str:
    return f"${x:,.2f}" if x >= 1 else f"${x:.6f}"


def _opt(x: float | int | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _lat(r: ModeResult, which: str) -> str:
    lat = getattr(r, which)
    return "-" if lat is None else f"{lat.p50:.2f}/{lat.p95:.2f}/{lat.p99:.2f}"


def results_table(an: Analysis) -> Table:
    w = an.workload
    table = Table(
        title=f"Cost at {w.requests_per_day:,.0f} requests/day ({w.arrival.value}), "
        f"{w.prompt_tokens} in / {w.output_tokens} out tokens (GPU rows simulated)",
        title_justify="left",
    )
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in ("entry", "mode") else "right")
    for r in sorted(an.results, key=lambda r: r.cost_per_day):
        table.add_row(
            r.entry_id,
            r.mode,
            _opt(r.billable_seconds_per_day, ",.0f"),
            _opt(r.replicas_at_peak, "d"),
            _opt(r.cold_starts_per_day, ",.1f"),
            _opt(r.waited_share, ".1%"),
            _lat(r, "ttft"),
            _lat(r, "e2e"),
            _money(r.cost_per_request),
            _money(r.cost_per_million_output),
            _money(r.cost_per_month),
        )
    return table


def render_text(an: Analysis, console: Console) -> None:
    for note in an.notes:
        console.print(note, highlight=False)
    console.print(f"service: {an.service.label}", highlight=False)
    console.print(results_table(an))
    console.print("[bold]Working[/bold]")
    for r in sorted(an.results, key=lambda r: r.cost_per_day):
        for line in r.working:
            console.print(f"  {r.entry_id}: {line}", highlight=False)
    console.print("[bold]Break-even rates between the cheapest entry of each mode (closed forms)[/bold]")
    if not an.break_evens:
        console.print("  none between 10 and 10,000,000 requests/day", highlight=False)
    for be in an.break_evens:
        kind = "" if be.continuous else " (a replica step, not a smooth crossing)"
        console.print(
            f"  {be.a} = {be.b} at {be.requests_per_day:,.0f} requests/day, "
            f"{_money(be.monthly_cost)}/month{kind}",
            highlight=False,
        )
    if an.snapshot:
        console.print("[bold]GPU snapshots instead of cold starts, per month[/bold]")
        for line in an.snapshot:
            console.print(f"  {line}", highlight=False)
    if an.fine_tunes is not None:
        console.print(f"[bold]{fine_tunes_heading(an.fine_tunes)}[/bold]", highlight=False)
        console.print(fine_tunes_table(an.fine_tunes))
    if an.advice:
        console.print("[bold]Advice[/bold]")
        for tip in an.advice:
            console.print(f"  {tip.setting}: {tip.value} - {tip.reason}", highlight=False)


def _p95(r: ModeResult) -> str:
    return "-" if r.ttft is None else f"{r.ttft.p95:.2f}"


def fine_tunes_heading(ft: FineTunes) -> str:
    n, overhead = ft.plan.fine_tunes, ft.plan.overhead
    assumed = " (none assumed: give --lora-overhead)" if overhead == 0 else ""
    return (
        f"{n} fine-tunes: one deployment serving {n} LoRA adapters, LoRA overhead {overhead:.0%} per token"
        f"{assumed}, against {n} deployments of {ft.requests_per_day_each:,.4g} requests/day each"
    )


def fine_tunes_table(ft: FineTunes) -> Table:
    n = ft.plan.fine_tunes
    title = "$/month, starts/day and p95 TTFT: one deployment / N deployments"
    table = Table(title=title, title_justify="left")
    for col in ("entry", "mode", "one deployment", f"{n} deployments", "saving", "starts/day", "p95 TTFT s"):
        table.add_column(col, justify="left" if col in ("entry", "mode") else "right")
    for row in sorted(ft.rows, key=lambda r: -r.saving_per_month):
        one, many = row.shared, row.separate
        table.add_row(
            row.entry,
            row.mode,
            _money(one.cost_per_month),
            _money(many.cost_per_month),
            _money(row.saving_per_month) if row.saving_per_month >= 0 else f"-{_money(-row.saving_per_month)}",
            f"{_opt(one.cold_starts_per_day, ',.1f')} / {_opt(many.cold_starts_per_day, ',.1f')}",
            f"{_p95(one)} / {_p95(many)}",
        )
    return table


def _fine_tunes_dict(ft: FineTunes | None) -> dict[str, Any] | None:
    if ft is None:
        return None
    return {
        "fine_tunes": ft.plan.fine_tunes,
        "lora_overhead": ft.plan.overhead,
        "requests_per_day_each": ft.requests_per_day_each,
        "rows": [
            {
                "entry": r.entry,
                "mode": r.mode,
                "one_deployment_cost_per_month": r.shared.cost_per_month,
                "n_deployments_cost_per_month": r.separate.cost_per_month,
                "saving_per_month": r.saving_per_month,
                "one_deployment_starts_per_day": r.shared.cold_starts_per_day,
                "n_deployments_starts_per_day": r.separate.cold_starts_per_day,
                "one_deployment_ttft_s": _latency(r.shared.ttft),
                "n_deployments_ttft_s": _latency(r.separate.ttft),
                "working": list(r.separate.working),
            }
            for r in ft.rows
        ],
    }


def _latency(lat: Any) -> dict[str, float] | None:
    return None if lat is None else {"p50": lat.p50, "p95": lat.p95, "p99": lat.p99}


def _row(r: ModeResult, cat: Catalogue) -> dict[str, Any]:
    entry = cat.entry(r.entry_id)
    return {
        "entry": r.entry_id,
        "platform": r.platform,
        "mode": r.mode,
        "price_source": entry.source,
        "price_read_on": entry.read_on,
        "price_note": entry.note,
        "billable_seconds_per_day": r.billable_seconds_per_day,
        "peak_containers": r.replicas_at_peak,
        "starts_per_day": r.cold_starts_per_day,
        "waited_on_startup_share": r.waited_share,
        "queued_on_max_containers_share": r.queued_share,
        "ttft_s": _latency(r.ttft),
        "e2e_s": _latency(r.e2e),
        "cost_per_request": r.cost_per_request,
        "cost_per_million_output_tokens": r.cost_per_million_output,
        "cost_per_day": r.cost_per_day,
        "cost_per_month": r.cost_per_month,
        "working": list(r.working),
    }


def to_dict(an: Analysis, inputs: dict[str, Any], cat: Catalogue) -> dict[str, Any]:
    s = an.service
    return {
        "schema": JSON_SCHEMA,
        "inputs": inputs,
        "assumptions": {
            "workload": an.workload.model_dump(mode="json"),
            "service": {
                "label": s.label,
                "cold_start_s": s.cold_start_s,
                "cold_start_source": s.cold_start_source,
                "prompt_ref_tokens": s.prompt_ref_tokens,
                "prefill_tokens_per_s": s.prefill_tokens_per_s,
                "points": [p.model_dump() for p in s.points],
            },
            "simulation": {"seed": an.overrides.seed, "max_containers": an.overrides.max_containers},
            "p95_ttft_target_s": an.p95_target_s,
        },
        "results": [_row(r, cat) for r in an.results],
        "break_evens": [be.__dict__ for be in an.break_evens],
        "snapshot": an.snapshot,
        "advice": [t.__dict__ for t in an.advice],
        "fine_tunes": _fine_tunes_dict(an.fine_tunes),
        "notes": an.notes,
    }


def render_json(an: Analysis, inputs: dict[str, Any], cat: Catalogue) -> str:
    return orjson.dumps(
        to_dict(an, inputs, cat), option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY
    ).decode()
