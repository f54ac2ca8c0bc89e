"""Read the cold-boot benchmark's JSON (schema bundle-coldboot/1): seconds to ready per boot.

`bench/coldboot.py` writes it (`bash bench/gpu.sh coldboot-cog` then `coldboot-rest` on the
H200): the Cog runner booted from an empty container (`cog-empty`) and with a compile-cache pack
(`cog-pack`), the HTTP server likewise (`serve-empty`, `serve-pack`). Without --coldboot the
H200 file, results/h200/coldboot/coldboot.json, is read when it is there, and the output says
which file it used; no figure is ever taken from anywhere else.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cost_model.errors import CostModelError
from cost_model.inputfile import read_text

SCHEMA = "bundle-coldboot/1"
H200_FILE = Path(__file__).resolve().parent.parent / "results" / "h200" / "coldboot" / "coldboot.json"
TARGETS = ("cog", "serve")
MAX_READY_S = 3600.0


@dataclass(frozen=True)
class ColdBoots:
    """Seconds from process start to ready (Cog: READY; the HTTP server: /health) per boot."""

    ready_s: dict[str, float]
    gpu: str | None
    origin: str

    def empty_and_pack(self, target: str) -> tuple[float, float]:
        """The median boot of each kind: `cog-empty` with its repeats `cog-empty-2`, ... if any."""
        names = (f"{target}-empty", f"{target}-pack")
        missing = [name for name in names if name not in self.ready_s]
        if missing:
            present = ", ".join(sorted(self.ready_s)) or "none"
            raise CostModelError(f"{self.origin} has no boot {', '.join(missing)} (has: {present})")
        return self.median(names[0]), self.median(names[1])

    def median(self, kind: str) -> float:
        return statistics.median(seconds for name, seconds in self.ready_s.items() if is_boot_of(name, kind))


def is_boot_of(name: str, kind: str) -> bool:
    """Whether boot `name` is of `kind`: the kind itself, or a repeat `kind-2`, `kind-3`, ..."""
    return name == kind or (name.startswith(f"{kind}-") and name.removeprefix(f"{kind}-").isdigit())


def choose_file(given: Path | None) -> Path:
    """`given`, else the H200 results when present; else a one-line error saying what to run."""
    if given is not None:
        return given
    if H200_FILE.is_file():
        return H200_FILE
    raise CostModelError(
        "no cold-boot figures: results/h200/coldboot/coldboot.json is not there yet (bash bench/gpu.sh "
        "coldboot-cog, then coldboot-rest); give --coldboot FILE, e.g. results/cpu/coldboot/coldboot.json "
        "(the CPU dry run)"
    )


def load_coldboot(path: Path) -> ColdBoots:
    text = read_text(path, "cold-boot")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise CostModelError(f"cannot read cold-boot file {path}: {str(exc).splitlines()[0]}") from None
    return parse_coldboot(data, str(path))


def parse_coldboot(data: Any, origin: str) -> ColdBoots:
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise CostModelError(f"malformed cold-boot JSON {origin}: expected schema '{SCHEMA}'")
    boots = data.get("boots")
    if not isinstance(boots, dict) or not boots:
        raise CostModelError(f"malformed cold-boot JSON {origin}: 'boots' must be a non-empty object")
    ready = {str(name): _ready(str(name), body) for name, body in boots.items()}
    return ColdBoots(ready, _gpu(data.get("machine")), origin)


def _ready(name: str, body: Any) -> float:
    value = body.get("ready_s") if isinstance(body, dict) else None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise CostModelError(f"malformed cold-boot JSON: boots.{name}.ready_s is not a number")
    if not 0 < value <= MAX_READY_S:
        raise CostModelError(
            f"cold-boot JSON: boots.{name}.ready_s {value:g} s is outside 0..{MAX_READY_S:g} s"
        )
    return float(value)


def _gpu(machine: Any) -> str | None:
    """The machine the boots ran on: bench/gpu.sh passes a description, a CPU run a dict."""
    if isinstance(machine, str):
        return machine or None
    if isinstance(machine, dict):
        gpu, cpu = machine.get("gpu"), machine.get("cpu")
        return gpu if isinstance(gpu, str) else (f"CPU {cpu}" if isinstance(cpu, str) else None)
    return None
