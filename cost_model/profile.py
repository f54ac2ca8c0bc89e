"""Assemble an honest service profile from flags, the benchmark JSON and the start-up JSON.

Start-up is never silently 0: it comes from --cold-start, the start-up benchmark's JSON, the
throughput benchmark's cold_start_s, or a stated default, and the choice is printed.
"""

from __future__ import annotations

import re
from typing import Any

from cost_model.benchfile import load_bench
from cost_model.errors import CostModelError
from cost_model.service import ServiceProfile, from_flags
from cost_model.startup import SNAPSHOT_RESTORE_SOURCE, load_startup

# The bundle's warm-compile-cache start on the lent H200, process start to first token, measured
# 2026-11-30 (DESIGN.md); used only when nothing better is given, and always said so.
DEFAULT_COLD_START_S = 38.0
DEFAULT_COLD_START_SOURCE = "stated default: the bundle's warm-cache H200 start measured 2026-11-30"


def _cold_start(v: dict[str, Any], bench_cold: float | None) -> tuple[float, str, list[str], float | None]:
    """(seconds, source, notes, snapshot start seconds or None)."""
    notes: list[str] = []
    snapshot = None
    if v.get("startup") is not None:
        paths = load_startup(v["startup"])
        name, seconds = paths.cold_path(v.get("startup_path"))
        source = f"{v['startup']} path '{name}' (median first token)"
        wake = paths.wake_s()
        if wake is not None:
            snapshot = wake + v["snapshot_restore_s"]
            notes.append(
                f"snapshot start: {snapshot:g} s = measured wake {wake:g} s "
                f"+ restore {v['snapshot_restore_s']:g} s "
                f"(--snapshot-restore-s; default from {SNAPSHOT_RESTORE_SOURCE})"
            )
        if paths.gpu:
            v["_gpus_measured"].append(paths.gpu)
        if v.get("cold_start") is None:
            return seconds, source, notes, snapshot
    if v.get("cold_start") is not None:
        return v["cold_start"], v.get("_cold_source", "--cold-start"), notes, snapshot
    if bench_cold is not None:
        return bench_cold, "the benchmark JSON's cold_start_s", notes, snapshot
    return DEFAULT_COLD_START_S, DEFAULT_COLD_START_SOURCE, notes, snapshot


def _check_single_point(profile: ServiceProfile, v: dict[str, Any]) -> None:
    if len(profile.points) == 1 and (v.get("concurrency") or 1) > 1 and not v.get("assume_flat_speed"):
        raise CostModelError(
            "one speed point cannot say how streams share a GPU: give --throughput C:N,... or --bench, "
            "or accept the optimistic --assume-flat-speed"
        )


def build_service(v: dict[str, Any]) -> tuple[ServiceProfile, list[str], float | None]:
    """The profile, notes to print, and the snapshot start-up (None without a wake path)."""
    v["_gpus_measured"] = []
    if v.get("bench") is not None:
        profile, bench_cold = load_bench(v["bench"])
        if v.get("prefill_tokens_per_s") is not None:
            profile = profile.model_copy(update={"prefill_tokens_per_s": v["prefill_tokens_per_s"]})
        if profile.gpu:
            v["_gpus_measured"].append(profile.gpu)
    else:
        prefill = v.get("prefill_tokens_per_s") or 10_000.0
        profile, bench_cold = (
            from_flags(v.get("tokens_per_s"), v.get("throughput"), v["ttft"], 0.0, prefill),
            None,
        )
    seconds, source, notes, snapshot = _cold_start(v, bench_cold)
    profile = profile.model_copy(update={"cold_start_s": seconds, "cold_start_source": source})
    _check_single_point(profile, v)
    notes.insert(0, f"start-up: {seconds:g} s ({source})")
    notes += gpu_warnings(v["_gpus_measured"], v.get("gpu"))
    return profile, notes, snapshot


def gpu_warnings(measured: list[str], priced: str | None) -> list[str]:
    if not priced:
        return []
    family = re.split(r"[-_ ]", priced)[0].lower()
    return [
        f"warning: speed/start-up measured on '{m}' but priced on {priced}: results carry the difference"
        for m in measured
        if family not in m.lower()
    ]
