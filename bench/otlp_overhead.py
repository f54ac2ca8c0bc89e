"""What the OTLP export costs (issue 52): the bundle's runs with it off and on, side by side.

`python -m bench.otlp_overhead OFF.json ON.json [--sink SINK.json] --out DIR` reads two bench
reports of the same lease (bench/gpu.sh stage `otlp`: the 8B shape at 256 streams, the export to
a local receiver, bench/otlp_sink.py) and writes DIR/otlp.md and DIR/otlp.json: output tokens per
second and the serving process's CPU per token at each level both ran, the on/off ratios, and
whether both stay within BOUND (2 %). The receiver's summary shows the export really ran (spans
and metric points received). Exit status 1 when a ratio is outside the bound.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

BOUND = 0.02  # the bar: tok/s and CPU per token within 2 % with the export on


def levels(report: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {level["concurrency"]: level for level in report["targets"]["bundle"]["levels"]}


def compare(off: dict[str, Any], on: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per concurrency both reports ran: the figures and the on/off ratios."""
    rows = []
    before, after = levels(off), levels(on)
    for concurrency in sorted(before.keys() & after.keys()):
        a, b = before[concurrency], after[concurrency]
        tokens = b["output_tokens_per_s"] / a["output_tokens_per_s"]
        cpu = b["serving_cpu_ms_per_token"] / a["serving_cpu_ms_per_token"]
        rows.append(
            {
                "concurrency": concurrency,
                "tokens_per_s": [a["output_tokens_per_s"], b["output_tokens_per_s"]],
                "cpu_ms_per_token": [a["serving_cpu_ms_per_token"], b["serving_cpu_ms_per_token"]],
                "tokens_ratio": tokens,
                "cpu_ratio": cpu,
                "within_bound": tokens >= 1 - BOUND and cpu <= 1 + BOUND,
            }
        )
    return rows


def markdown(rows: list[dict[str, Any]], sink: dict[str, Any] | None, machine: str) -> str:
    lines = [
        "| streams | tok/s off | tok/s on | on/off | CPU ms/token off | on | on/off | within 2 % |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        (t0, t1), (c0, c1) = row["tokens_per_s"], row["cpu_ms_per_token"]
        lines.append(
            f"| {row['concurrency']} | {t0:,.0f} | {t1:,.0f} | {row['tokens_ratio']:.3f} | {c0:.4f} | "
            f"{c1:.4f} | {row['cpu_ratio']:.3f} | {'yes' if row['within_bound'] else 'NO'} |"
        )
    lines += ["", f"Machine: {machine}."]
    if sink is not None:
        lines.append(
            f"Receiver: {sink['spans']:,} spans in {sink['trace_requests']:,} requests, "
            f"{sink['metric_points']:,} metric points in {sink['metric_requests']:,} exports."
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("off", type=Path)
    parser.add_argument("on", type=Path)
    parser.add_argument("--sink", type=Path, help="bench/otlp_sink.py's summary")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    off, on = json.loads(args.off.read_text()), json.loads(args.on.read_text())
    sink = json.loads(args.sink.read_text()) if args.sink else None
    rows = compare(off, on)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "otlp.json").write_text(json.dumps({"bound": BOUND, "rows": rows, "sink": sink}, indent=2))
    table = markdown(rows, sink, str(on.get("machine", "")))
    (args.out / "otlp.md").write_text(table)
    print(table)
    exported = sink is None or (sink["spans"] > 0 and sink["metric_points"] > 0)
    return 0 if rows and exported and all(row["within_bound"] for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
