"""The suite's plot: throughput and median time to first token against concurrency."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.report import median_ttft_p50_s


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, target in report["targets"].items():
        xs = [lv["concurrency"] for lv in target["levels"]]
        left.plot(xs, [lv["output_tokens_per_s"] for lv in target["levels"]], marker="o", label=name)
        right.plot(xs, [median_ttft_p50_s(lv) * 1000 for lv in target["levels"]], marker="o", label=name)
    for axis, label in ((left, "output tokens/s"), (right, "TTFT p50 (ms)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrent streams")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
        axis.legend()
    fig.suptitle(f"{report['model']} on {report['machine']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
