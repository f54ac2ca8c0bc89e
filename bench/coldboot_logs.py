"""Start-up phases of the Cog runner, read from coglet's log (one JSON object per line).

Coglet stamps every line it logs, its own and the runner's (stdout/stderr of the worker and of
vLLM's forked engine core), with an ISO timestamp, so the phases need no guessing: each is the
time from the previous milestone seen to the first line matching the next. vLLM's own lines
are matched loosely, as bench/startup.py does (their wording moves between releases); the
bundle's are its own log lines. A milestone whose line never appears is left out.
"""

from __future__ import annotations

import contextlib
import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.startup import phases

# (name, pattern) in the order they happen during setup.
COG_MILESTONES: tuple[tuple[str, str], ...] = (
    ("coglet_up", r"^Running setup$"),  # coglet's worker loaded the runner; setup() begins
    ("prepared", r"start prepared in"),  # weights + pack fetched while vLLM imported
    ("pack_applied", r"^(INFO|WARNING) shared\.cache\.start: compile-cache pack"),
    ("engine_starting", r"starting vLLM with model"),
    ("model_config", r"Resolved architecture"),
    ("engine_core_up", r"Initializing a V1 LLM engine"),
    ("weights_loaded", r"Model loading took|Loading weights took"),
    ("torch_compile", r"torch\.compile (took|takes) |Warming up done"),
    ("kv_cache", r"KV cache size: [\d,]+ tokens|Available KV cache memory"),
    ("cuda_graphs", r"(?<!Encoder )Graph capturing finished"),
    ("engine_init", r"init engine \(.*\) took"),
    ("warm_up", r"warm-up done in"),
    ("setup_complete", r"^Setup complete$"),
)
IMPORT_SECONDS = re.compile(r"vLLM imported in ([\d.]+) s")
PACK_LINE = re.compile(r"compile-cache pack .*")


def coglet_lines(log: Path) -> list[tuple[float, str]]:
    """(unix time, message) of every JSON line of coglet's log; other lines are skipped."""
    found = []
    for raw in log.read_text(errors="replace").splitlines():
        try:
            entry = json.loads(raw)
            stamp = datetime.fromisoformat(entry["timestamp"].replace("Z", "+00:00")).timestamp()
            found.append((stamp, str(entry["fields"]["message"]).strip()))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    return found


def setup_errors(log: Path) -> list[str]:
    """The `error` fields coglet logs when setup fails (the runner's exception is there)."""
    found = []
    for raw in log.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
            error = json.loads(raw)["fields"].get("error")
            if error:
                found.append(str(error)[:1000])
    return found


def cog_phases(log: Path, spawned: float) -> dict[str, Any]:
    """Milestones (seconds since coglet was spawned), phases between them, and the roll-up the
    issue's table uses: imports (setup() to the start prepared: vLLM's import, beside the
    downloads), engine init (to vLLM's "init engine ... took"), warm-up, ready."""
    lines = coglet_lines(log)
    seen: dict[str, float] = {}
    for name, pattern in COG_MILESTONES:
        regex = re.compile(pattern)
        at = next((stamp for stamp, message in lines if regex.search(message)), None)
        if at is not None:
            seen[name] = round(at - spawned, 3)
    return {
        "milestones": seen,
        "phases": phases(seen),
        "rollup": rollup(seen),
        "vllm_import_s": _import_seconds(lines),
        "pack_lines": [m.group(0)[:400] for _, message in lines if (m := PACK_LINE.search(message))],
    }


def rollup(seen: dict[str, float]) -> dict[str, float]:
    """The issue's columns, where their milestones were seen. Imports end where the engine start
    begins: "start prepared" (imports beside the downloads), or in older logs "starting vLLM"."""
    begins = next((seen[name] for name in ("prepared", "engine_starting") if name in seen), None)
    spans = {
        "imports_s": (seen.get("coglet_up"), begins),
        "engine_init_s": (begins, seen.get("engine_init")),
        "warm_up_s": (seen.get("engine_init"), seen.get("warm_up")),
        "setup_s": (seen.get("coglet_up"), seen.get("setup_complete")),
    }
    return {name: round(b - a, 3) for name, (a, b) in spans.items() if a is not None and b is not None}


def _import_seconds(lines: list[tuple[float, str]]) -> float | None:
    for _, message in lines:
        if found := IMPORT_SECONDS.search(message):
            return float(found.group(1))
    return None


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.coldboot_logs COGLET.LOG`: the phases of a coglet log made elsewhere
    (bench/gpu.sh cog's coglet.log, say), timed from its first line."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m bench.coldboot_logs", description=main.__doc__)
    parser.add_argument("log", type=Path)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    lines = coglet_lines(args.log)
    if not lines:
        parser.error(f"{args.log} holds no coglet JSON lines")
    found = cog_phases(args.log, lines[0][0])
    print(json.dumps({k: found[k] for k in ("rollup", "phases", "vllm_import_s")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
