"""The suite's report as markdown: one row per level, one cell per target, then the CPU table
and a footer with the workload, the engines' prefill budgets and the capacity run."""

from __future__ import annotations

from typing import Any

TARGETS = ("raw", "bundle", "vllm_server")


def markdown_table(report: dict[str, Any]) -> str:
    targets = report["targets"]
    by_level = {t: {lv["concurrency"]: lv for lv in targets[t]["levels"]} for t in targets}
    levels = sorted({c for t in by_level.values() for c in t})
    names = [t for t in TARGETS if t in targets]
    head = (
        "| concurrency | "
        + " | ".join(f"{t}: tok/s · TTFT p50 ms · ITL p50/p99 ms" for t in names)
        + " | bundle/raw | bundle/vLLM server |"
    )
    rows = [head, "|" + "---|" * (len(names) + 3)]
    for level in levels:
        cells = [_cell(by_level[t].get(level)) for t in names]
        rows.append(
            f"| {level} | " + " | ".join(cells) + f" | {_ratio(by_level, level, 'raw')} | "
            f"{_ratio(by_level, level, 'vllm_server')} |"
        )
    rows += _cpu_table(by_level, names, levels)
    footer = [
        f"\n{report['machine']}; model {report['model']}; {report['date']}; workload "
        f"{report['workload']['prompt_tokens']} prompt tokens, "
        f"{report['workload']['output_tokens']} output tokens (ignore_eos), temperature 0."
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
    return "\n".join(rows + footer) + "\n"


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


def _cell(level: dict | None) -> str:
    if level is None:
        return "-"
    return (
        f"{level['output_tokens_per_s']:,.0f} · {level['ttft_s']['p50'] * 1000:.1f} · "
        f"{level['itl_s']['p50'] * 1000:.1f}/{level['itl_s']['p99'] * 1000:.1f}"
    )


def _ratio(by_level: dict, level: int, other: str) -> str:
    mine, theirs = by_level.get("bundle", {}).get(level), by_level.get(other, {}).get(level)
    if not mine or not theirs or not theirs["output_tokens_per_s"]:
        return "-"
    return f"{mine['output_tokens_per_s'] / theirs['output_tokens_per_s']:.2f}"
