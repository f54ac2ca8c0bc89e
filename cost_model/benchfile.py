"""Read the benchmark's JSON (schema bundle-bench/1) into a ServiceProfile."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cost_model.errors import CostModelError
from cost_model.inputfile import read_text
from cost_model.service import ServiceProfile, ThroughputPoint

PREFERRED_TARGET = "bundle"


def _pick_target(targets: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    if PREFERRED_TARGET in targets:
        return PREFERRED_TARGET, targets[PREFERRED_TARGET]
    name = next(iter(targets))
    return name, targets[name]


def _point(level: dict[str, Any]) -> ThroughputPoint | None:
    conc = float(level["concurrency"])
    per_stream = level.get("per_stream_tokens_per_s")
    if not per_stream:
        # Fall back to the aggregate split evenly when the median per-stream rate is missing.
        aggregate = float(level.get("output_tokens_per_s") or 0.0)
        per_stream = aggregate / conc if conc else 0.0
    if per_stream <= 0:
        return None  # a level that produced nothing (e.g. all errors) carries no information
    ttft = (level.get("ttft_s") or {}).get("p50")
    return ThroughputPoint(
        concurrency=conc,
        per_stream_tokens_per_s=float(per_stream),
        ttft_s=None if ttft is None else float(ttft),
    )


def _prefill(data: dict[str, Any], points: list[ThroughputPoint]) -> dict[str, float]:
    """Prompt length the TTFTs were measured at, and a prefill rate from the one-stream TTFT.

    All of the one-stream TTFT is counted as prefill, which makes longer prompts cost at least
    as much as they really do (a conservative reading of one measured prompt length).
    """
    prompt = int((data.get("workload") or {}).get("prompt_tokens") or 0)
    first = points[0].ttft_s if points else None
    if prompt <= 0 or not first:
        return {}
    return {"prompt_ref_tokens": prompt, "prefill_tokens_per_s": prompt / first}


def profile_from_bench(data: dict[str, Any]) -> tuple[ServiceProfile, float | None]:
    """Convert a parsed benchmark document (extra keys ignored); also its cold_start_s, if any."""
    try:
        name, target = _pick_target(data["targets"])
        levels = target["levels"]
        points = [p for p in (_point(lv) for lv in levels) if p is not None]
        points.sort(key=lambda p: p.concurrency)
        cold = data.get("cold_start_s")
        if cold is not None and not (isinstance(cold, int | float) and 0 <= cold <= 3600):
            raise ValueError(f"cold_start_s must be a number of seconds within 0..3600, got {cold!r}")
        machine = str(data.get("machine", "?"))
        profile = ServiceProfile(
            points=tuple(points),
            ttft_s=points[0].ttft_s or 0.0 if points else 0.0,
            label=f"bench {data.get('model', '?')} on {machine} ({name})",
            gpu=machine,
            **_prefill(data, points),
        )
        return profile, None if cold is None else float(cold)
    except (KeyError, TypeError, StopIteration, AttributeError, OverflowError) as exc:
        raise CostModelError(f"malformed benchmark JSON: missing or wrong field {exc}") from None
    except ValueError as exc:
        raise CostModelError(f"malformed benchmark JSON: {str(exc).splitlines()[0]}") from None


def load_bench(path: Path) -> tuple[ServiceProfile, float | None]:
    text = read_text(path, "benchmark")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise CostModelError(f"cannot read benchmark file {path}: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise CostModelError(f"malformed benchmark JSON {path}: top level must be an object")
    return profile_from_bench(data)
