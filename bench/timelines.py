"""Every request's timeline, kept beside a report, and what it says that percentiles do not.

A level's p50 time to first token mixes two kinds of request: the first wave, all started at
once (a burst the engine prefills a batch at a time), and the later ones, each started when an
earlier one ends. Which part of the burst a target is slower for says where its time goes:
a constant delay for every request is per-request overhead (parsing, admission), a delay that
grows along the burst is a queue (a busy event loop, requests reaching the engine one by one).

`bench.json` keeps summaries; the rows ([started, first token, end] in ms from the level's
start, per request, per run) go to `timelines.json` beside it, one entry per target and level.

    python -m bench timelines bench/gpu-results/bench/timelines.json [--against raw]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

import orjson

FILE_NAME = "timelines.json"
SLICES = 4  # the first wave in quarters by start order


def split_off(targets: dict[str, Any]) -> dict[str, dict[str, list]]:
    """Remove every level's `runs_timeline_ms` from `targets` (in place) and return them as
    {target: {level: [one list of rows per run]}}."""
    taken: dict[str, dict[str, list]] = {}
    for name, target in targets.items():
        for level in target.get("levels", []):
            runs = level.pop("runs_timeline_ms", None)
            if runs:
                taken.setdefault(name, {})[str(level["concurrency"])] = runs
    return taken


def write(out: Path, timelines: dict[str, dict[str, list]], merge: bool) -> None:
    """timelines.json in `out`; with `merge`, the targets already in it are kept unless rerun."""
    path = out / FILE_NAME
    kept = orjson.loads(path.read_bytes()) if merge and path.exists() else {}
    if timelines or kept:
        path.write_bytes(orjson.dumps({**kept, **timelines}))


def wave_summary(rows: list[list[float]], concurrency: int) -> dict[str, float]:
    """Mean TTFT (ms) of the first wave by quarter of start order, and of the later requests.
    (In an open loop, `--request-rate`, there is no burst: the "first wave" is then just the
    level's first `concurrency` arrivals.)"""
    ok = [row for row in rows if row[1] >= 0]
    first, later = ok[:concurrency], ok[concurrency:]
    summary: dict[str, float] = {}
    size = max(1, len(first) // SLICES)
    for part in range(SLICES):
        chunk = first[part * size : (part + 1) * size] if part < SLICES - 1 else first[part * size :]
        if chunk:
            summary[f"first wave q{part + 1}"] = statistics.fmean(r[1] - r[0] for r in chunk)
    if later:
        summary["later"] = statistics.fmean(r[1] - r[0] for r in later)
        # When later requests start: how long the first wave's ends took to come round.
        summary["later starts (median)"] = statistics.median(r[0] for r in later)
    summary["all"] = statistics.fmean(r[1] - r[0] for r in ok) if ok else 0.0
    return summary


def report(timelines: dict[str, dict[str, list]], against: str | None) -> str:
    lines = []
    for level in sorted({int(lv) for target in timelines.values() for lv in target}):
        lines.append(f"concurrency {level}: mean TTFT in ms, median over runs")
        rows: dict[str, dict[str, float]] = {}
        for name, target in timelines.items():
            runs = target.get(str(level))
            if runs:
                per_run = [wave_summary(run, level) for run in runs]
                rows[name] = {key: statistics.median(r[key] for r in per_run if key in r) for key in per_run[0]}
        base = rows.get(against or "")
        for name, summary in rows.items():
            compared = base if name != against else None
            cells = "  ".join(f"{key} {v:7.1f}{_difference(v, key, compared)}" for key, v in summary.items())
            lines.append(f"  {name:>14}: {cells}")
    return "\n".join(lines)


def _difference(value: float, key: str, base: dict[str, float] | None) -> str:
    return f" ({value - base[key]:+.1f})" if base and key in base else ""


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        usage = f"usage: python -m bench timelines {FILE_NAME} [MORE.json ...] [--against TARGET]"
        print(usage, file=sys.stderr)
        return 2
    against = None
    if "--against" in argv:
        at = argv.index("--against")
        against = argv[at + 1] if at + 1 < len(argv) else None
        argv = argv[:at] + argv[at + 2 :]
    timelines: dict[str, dict[str, list]] = {}
    for path in argv:
        try:
            timelines.update(orjson.loads(Path(path).read_bytes()))
        except (OSError, orjson.JSONDecodeError) as exc:
            print(f"python -m bench timelines: {path}: {exc}", file=sys.stderr)
            return 2
    print(report(timelines, against))
    return 0
