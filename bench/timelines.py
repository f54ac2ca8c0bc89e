"""Every request's timeline, kept beside a report, and what it says that percentiles do not.

A level's p50 time to first token mixes two kinds of request: the first wave, all started at
once (a burst the engine prefills a batch at a time), and the later ones, each started when an
earlier one ends. Which part of the burst a target is slower for says where its time goes:
a constant delay for every request is per-request overhead (parsing, admission), a delay that
grows along the burst is a queue (a busy event loop, requests reaching the engine one by one).

`bench.json` keeps summaries; the rows ([due, first token, end, sent] in ms from the level's
start, per request, per run; files from before requests were timed from when they were due
have [sent, first token, end]) go to `timelines.json` beside it, one entry per target and level.

    python -m bench timelines bench/gpu-results/bench/timelines.json [--against raw]

After the TTFT by wave, the later requests per run: their mean time from start to end and to
first token, the mean time per output token after the first (the output length is read from
`bench.json` beside the file, or `--output-tokens N`), and in a closed loop how soon a client
sent its next request after one ended. At the same throughput and concurrency a closed loop
fixes the time a request spends in the system (Little's law): a target whose TTFT is higher
there but whose start-to-end is not spends less of it decoding.
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
    for level in _levels(timelines):
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


def steady_state(rows: list[list[float]], concurrency: int, output_tokens: int) -> dict[str, float]:
    """The later requests (after the level's first `concurrency` starts) of one run, in ms.
    Rows come in start order (`bench.loadgen.timeline_ms`), as `wave_summary` reads them."""
    ok = [row for row in rows if row[1] >= 0]
    later = ok[concurrency:]
    if not later:
        return {}
    summary = {
        "start to end": statistics.fmean(r[2] - r[0] for r in later),
        "TTFT": statistics.fmean(r[1] - r[0] for r in later),
    }
    if output_tokens > 1:
        after_first = output_tokens - 1
        summary["per token after the first"] = statistics.fmean((r[2] - r[1]) / after_first for r in later)
    summary["sent after due (median)"] = statistics.median(_send_delays(later, ok))
    gap = longest_first_token_gap(ok[:concurrency])
    if gap is not None:
        summary["first wave: longest gap between first tokens"] = gap
    return summary


def longest_first_token_gap(first_wave: list[list[float]]) -> float | None:
    """The longest time (ms) in which none of the opening burst got its first token, between its
    first and its last one. The engine prefills a burst a step at a time, so this is about one
    prefill step (~190-250 ms at 256 streams on the H200). On the H200 the first run after an
    engine start mostly showed one step about twice as long, raw's as often as the bundle's,
    and a run's TTFT p50 did not follow it."""
    firsts = sorted(row[1] for row in first_wave if row[1] >= 0)
    if len(firsts) < 2:
        return None
    return max(b - a for a, b in zip(firsts, firsts[1:], strict=False))


def _send_delays(later: list[list[float]], ok: list[list[float]]) -> list[float]:
    """How long after it was due each later request was sent (ms). Rows since the benchmark
    times requests from when they were due carry the send as a 4th column; in older ones the
    first column is the send, and in a closed loop the k-th later start answers the k-th end
    (the level's last ends answer none)."""
    if all(len(r) > 3 for r in later):
        return [r[3] - r[0] for r in later]
    ends = sorted(r[2] for r in ok)
    return [r[0] - end for r, end in zip(later, ends, strict=False)]


def steady_report(timelines: dict[str, dict[str, list]], output_tokens: int) -> str:
    lines = [
        "later requests, per run (ms; in older files, 'sent after due' means something only in a closed loop)"
    ]
    for level in _levels(timelines):
        for name, target in timelines.items():
            per_run = [steady_state(run, level, output_tokens) for run in target.get(str(level), [])]
            per_run = [summary for summary in per_run if summary]
            if not per_run:
                continue
            cells = "  ".join(
                f"{key} " + " / ".join(f"{summary[key]:.1f}" for summary in per_run) for key in per_run[0]
            )
            lines.append(f"  c={level:<4} {name:>14}: {cells}")
    return "\n".join(lines)


def _levels(timelines: dict[str, dict[str, list]]) -> list[int]:
    return sorted({int(level) for target in timelines.values() for level in target})


def _difference(value: float, key: str, base: dict[str, float] | None) -> str:
    return f" ({value - base[key]:+.1f})" if base and key in base else ""


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        usage = f"usage: python -m bench timelines {FILE_NAME} [MORE.json ...] [--against TARGET]"
        print(usage, file=sys.stderr)
        return 2
    against, argv = _option(argv, "--against")
    tokens, argv = _option(argv, "--output-tokens")
    if tokens is not None and not tokens.isdigit():
        print(f"python -m bench timelines: --output-tokens must be a whole number: {tokens!r}", file=sys.stderr)
        return 2
    timelines: dict[str, dict[str, list]] = {}
    for path in argv:
        try:
            timelines.update(orjson.loads(Path(path).read_bytes()))
        except (OSError, orjson.JSONDecodeError) as exc:
            print(f"python -m bench timelines: {path}: {exc}", file=sys.stderr)
            return 2
    print(report(timelines, against))
    print(steady_report(timelines, int(tokens) if tokens else _output_tokens_beside(Path(argv[0]))))
    return 0


def _option(argv: list[str], name: str) -> tuple[str | None, list[str]]:
    if name not in argv:
        return None, argv
    at = argv.index(name)
    return (argv[at + 1] if at + 1 < len(argv) else None), argv[:at] + argv[at + 2 :]


def _output_tokens_beside(timelines_path: Path) -> int:
    """The workload's output length from the report beside the file (0 if there is none, or
    if each request had its own: `output_spread`)."""
    try:
        report = orjson.loads((timelines_path.parent / "bench.json").read_bytes())
        if report["workload"].get("output_spread"):
            return 0
        return int(report["workload"]["output_tokens"])
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return 0
