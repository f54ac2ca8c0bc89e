"""The suite's report as markdown: one row per level, one cell per target, the ratios that
matter, the CPU table, and a footer with the workload, the engines' prefill budgets and the
capacity run. Cells: median tok/s (± half the spread of the runs, % of the median) · TTFT p50
ms (the median of the runs' p50s) · ITL p50/p99 ms (of the median-throughput run) · prefix-cache
hit rate."""

from __future__ import annotations

import statistics
from typing import Any

from bench.specs import NO_PREFIX_CACHE


def ratio_pairs(names: list[str]) -> list[tuple[str, str]]:
    """(numerator, denominator) target pairs shown as ratio columns, where both were run."""
    pairs = [("bundle", "raw"), ("bundle", "vllm_server")]
    pairs += [(name, "vllm_server:defaults") for name in names if name.startswith("bundle:")]
    for name in names:  # bundle@N: against raw, one process, and vLLM's server with as many
        if name.startswith("bundle@"):
            pairs += [(name, "raw"), (name, "bundle"), (name, "vllm_server" + name[len("bundle") :])]
    pairs += [(name, name + NO_PREFIX_CACHE) for name in names]
    present = set(names)
    return [(a, b) for a, b in pairs if a in present and b in present and a != b]


def markdown_table(report: dict[str, Any]) -> str:
    targets = report["targets"]
    by_level = {t: {lv["concurrency"]: lv for lv in targets[t]["levels"]} for t in targets}
    levels = sorted({c for t in by_level.values() for c in t})
    names = list(targets)
    pairs = ratio_pairs(names)
    head = (
        "| concurrency | "
        + " | ".join(f"{t}: tok/s · TTFT p50 ms · ITL p50/p99 ms · prefix hits" for t in names)
        + "".join(f" | {_ratio_label(a, b)}" for a, b in pairs)
        + " |"
    )
    rows = [head, "|" + "---|" * (len(names) + len(pairs) + 1)]
    for level in levels:
        cells = [_cell(by_level[t].get(level)) for t in names]
        ratios = [_ratio(by_level, level, a, b) for a, b in pairs]
        rows.append(f"| {level} | " + " | ".join(cells + ratios) + " |")
    rows += _cpu_table(by_level, names, levels)
    rows += _cpu_by_process_table(by_level, names, levels)
    return "\n".join(rows + _footer(report, names)) + "\n"


def _ratio_label(mine: str, other: str) -> str:
    return f"{mine}: prefix cache on/off" if other == mine + NO_PREFIX_CACHE else f"{mine} / {other}"


def _rounds(report: dict[str, Any]) -> str:
    rounds = report.get("rounds")
    rate = report["workload"].get("request_rate")
    loop = f"open loop, {rate:g} requests/s (Poisson), the level a cap on those in flight; " if rate else ""
    think = report["workload"].get("think_s")
    if think:
        kind = " (the mean; exponential)" if report["workload"].get("think_random") else ""
        loop += f"{think * 1000:g} ms think time after each response{kind}; "
    return loop + (f"{rounds} rounds (level x {rounds} requests, at least 16); " if rounds else "")


def _spread_of(workload: dict[str, Any]) -> str:
    spread = workload.get("output_spread") or 0.0
    return f" ±{spread:.0%} (uniform, per request)" if spread else ""


def _footer(report: dict[str, Any], names: list[str]) -> list[str]:
    targets, workload = report["targets"], report["workload"]
    prefix = workload.get("shared_prefix_tokens", 0)
    footer = [
        f"\n{report['machine']}; model {report['model']}; {report['date']}; workload "
        + (f"{prefix} shared prefix tokens + " if prefix else "")
        + f"{workload['prompt_tokens']} unique prompt tokens, {workload['output_tokens']}"
        + _spread_of(workload)
        + " output tokens (ignore_eos), temperature 0; "
        + _rounds(report)
        + f"median of {report.get('repeat', 1)} runs per level."
    ]
    budgets = {t: targets[t].get("max_num_batched_tokens") for t in names}
    if any(budgets.values()):
        footer.append(
            "Engine prefill budget (max_num_batched_tokens): "
            + ", ".join(f"{t} {b if b is not None else 'not logged'}" for t, b in budgets.items())
            + "."
        )
    cap = targets.get("bundle", {}).get("capacity")
    if cap:
        footer.append(
            f"Capacity: {cap['concurrency']} concurrent streams through the bundle, "
            f"{cap['errors']} failed, ITL p99 {cap['itl_s']['p99'] * 1000:.1f} ms, "
            f"server peak RSS {cap.get('server_peak_rss_mib', 0):.0f} MiB."
        )
    return footer


def _cpu_table(by_level: dict, names: list[str], levels: list[int]) -> list[str]:
    """CPU ms per output token of each target's serving process, where it was measured."""
    measured = [t for t in names if any("serving_cpu_ms_per_token" in lv for lv in by_level[t].values())]
    if not measured:
        return []
    rows = [
        "\nCPU time of the serving process per output token, ms (raw: the benchmark process itself):\n",
        "| concurrency | " + " | ".join(measured) + " |",
        "|" + "---|" * (len(measured) + 1),
    ]
    for level in levels:
        cells = [by_level[t].get(level, {}).get("serving_cpu_ms_per_token") for t in measured]
        rows.append(f"| {level} | " + " | ".join("-" if c is None else f"{c:.3f}" for c in cells) + " |")
    return rows


def _cpu_by_process_table(by_level: dict, names: list[str], levels: list[int]) -> list[str]:
    """CPU ms per output token by process: the API processes together (and the busiest one),
    vLLM's engine core, and the rest (a supervisor, a local store)."""
    measured = [t for t in names if any("cpu_ms_per_token" in lv for lv in by_level[t].values())]
    if not measured:
        return []
    rows = [
        "\nCPU per output token by process, ms: API processes together (the busiest one) · engine core · "
        "other processes (raw: the benchmark process is the API side):\n",
        "| concurrency | " + " | ".join(measured) + " |",
        "|" + "---|" * (len(measured) + 1),
    ]
    for level in levels:
        cells = [_roles_cell(by_level[t].get(level, {}).get("cpu_ms_per_token")) for t in measured]
        rows.append(f"| {level} | " + " | ".join(cells) + " |")
    return rows


def _roles_cell(roles: dict[str, float] | None) -> str:
    if not roles:
        return "-"
    each = [cpu for role, cpu in roles.items() if role.startswith("api.")]
    busiest = f" ({max(each):.3f})" if len(each) > 1 else ""
    return f"{roles['api']:.3f}{busiest} · {roles.get('engine', 0.0):.3f} · {roles.get('other', 0.0):.3f}"


def _cell(level: dict | None) -> str:
    if level is None:
        return "-"
    cache = level.get("prefix_cache")
    return (
        f"{level['output_tokens_per_s']:,.0f}{_spread(level)} · {median_ttft_p50_s(level) * 1000:.1f} · "
        f"{level['itl_s']['p50'] * 1000:.1f}/{level['itl_s']['p99'] * 1000:.1f} · "
        + (f"{cache['hit_rate']:.1%}" if cache else "-")
    )


def median_ttft_p50_s(level: dict) -> float:
    """The median of the runs' TTFT p50s: the run kept for its median throughput need not have
    the median TTFT (in an open loop the rate sets the throughput, so it hardly ranks runs)."""
    return statistics.median(level.get("runs_ttft_p50_s") or [level["ttft_s"]["p50"]])


def _spread(level: dict) -> str:
    """' ±x%': half the range of the runs' throughput, relative to the median; '' for one run."""
    runs = level.get("runs_output_tokens_per_s") or []
    if len(runs) < 2 or not level["output_tokens_per_s"]:
        return ""
    return f" ±{50 * (max(runs) - min(runs)) / level['output_tokens_per_s']:.0f}%"


def _ratio(by_level: dict, level: int, mine: str, other: str) -> str:
    a, b = by_level.get(mine, {}).get(level), by_level.get(other, {}).get(level)
    if not a or not b or not b["output_tokens_per_s"]:
        return "-"
    return f"{a['output_tokens_per_s'] / b['output_tokens_per_s']:.2f}"
