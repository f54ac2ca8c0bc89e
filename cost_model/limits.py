"""Bounds for every number the command line accepts, and argparse types that enforce them.

Bounds keep every input finite and every run short: the simulation's size depends on the sample
budget, never on these values, but absurd values (a year-long start-up, 10^12 tokens) say
nothing useful and are refused with one line instead.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

BOUNDS: dict[str, tuple[float, float]] = {
    "requests-per-day": (0.01, 1e7),
    "requests-per-hour": (0.01 / 24, 1e7 / 24),
    "peak-factor": (1.0, 24.0),
    "peak-hours": (0.1, 24.0),
    "prompt-tokens": (0, 1_000_000),
    "output-tokens": (1, 1_000_000),
    "tokens-per-s": (0.01, 1e6),
    "ttft": (0.0, 600.0),
    "cold-start": (0.0, 3600.0),
    "snapshot-restore-s": (0.0, 3600.0),
    "prefill-tokens-per-s": (1.0, 1e8),
    "price-per-second": (1e-9, 10.0),
    "price-per-hour": (1e-6, 10_000.0),
    "price-per-request": (1e-9, 100.0),
    "concurrency": (1, 1024),
    "scaledown-window": (0.0, 86_400.0),
    "min-containers": (0, 1000),
    "max-containers": (1, 10_000),
    "cpu-cores": (0.0, 512.0),
    "memory-gib": (0.0, 4096.0),
    "max-cold-fraction": (0.0, 1.0),
    "p95-ttft-s": (0.001, 3600.0),
    "seed": (0, 2**31 - 1),
    "model-params-b": (0.01, 10_000.0),
    # One deployment with a thousand adapters is already far past vLLM's per-batch adapter limits.
    "fine-tunes": (1, 1000),
    "lora-overhead": (0.0, 1.0),  # 1.0: every token twice as slow with adapters
}


def _check(name: str, value: float) -> float:
    lo, hi = BOUNDS[name]
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"--{name} must be a finite number, got {value!r}")
    if not lo <= value <= hi:
        raise argparse.ArgumentTypeError(f"--{name} must be within {lo:g}..{hi:g}, got {value:g}")
    return value


def number(name: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--{name} wants a number, got '{text}'") from None
        return _check(name, value)

    return parse


def integer(name: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--{name} wants a whole number, got '{text}'") from None
        return int(_check(name, value))

    return parse


class OneLineParser(argparse.ArgumentParser):
    """argparse prints usage and exits 2 on errors; here the error is one line on stderr."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"error: {message.splitlines()[0]}\n")
