"""How fast one replica serves requests, as a function of how many streams share it."""

from __future__ import annotations

import math
from bisect import bisect_right
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cost_model.errors import CostModelError

# Assumed prefill speed when nothing measured says otherwise: an 8B bf16 model on an A100-class
# GPU processes prompts at roughly this rate (the H200 benchmark implies at least 20,000/s).
DEFAULT_PREFILL_TOKENS_PER_S = 10_000.0
MAX_CURVE_POINTS = 64


class ThroughputPoint(BaseModel):
    """One measured concurrency level."""

    model_config = ConfigDict(frozen=True, allow_inf_nan=False)
    concurrency: Annotated[float, Field(ge=1)]
    per_stream_tokens_per_s: Annotated[float, Field(gt=0)]
    ttft_s: Annotated[float, Field(ge=0)] | None = None


class ServiceProfile(BaseModel):
    """Throughput-vs-concurrency curve plus latency to first token and cold-start time.

    Between measured points the per-stream rate is interpolated linearly. Below the first
    point it is held. Above the last point the *aggregate* rate is held (more streams only
    split the same tokens/s), and the queueing model never credits concurrency beyond the
    last measured level, because nothing says the GPU can do better there.
    """

    model_config = ConfigDict(frozen=True, allow_inf_nan=False)
    points: tuple[ThroughputPoint, ...]
    ttft_s: Annotated[float, Field(ge=0)] = 0.0
    cold_start_s: Annotated[float, Field(ge=0)] = 0.0
    label: str = "flags"
    # Prefill: TTFT was measured at prompt_ref_tokens; each further prompt token adds 1/prefill.
    prompt_ref_tokens: Annotated[int, Field(ge=0)] = 0
    prefill_tokens_per_s: Annotated[float, Field(gt=0)] = DEFAULT_PREFILL_TOKENS_PER_S
    cold_start_source: str = "given"
    gpu: str | None = None  # the GPU the speed was measured on, when known

    @model_validator(mode="after")
    def _sorted_unique(self) -> ServiceProfile:
        if not self.points:
            raise ValueError("the throughput curve needs at least one point")
        levels = [p.concurrency for p in self.points]
        if len(levels) > MAX_CURVE_POINTS or max(levels) > 1024:
            raise ValueError(f"at most {MAX_CURVE_POINTS} levels, concurrency at most 1024")
        if levels != sorted(set(levels)):
            raise ValueError("throughput points must have distinct, increasing concurrency")
        return self

    @property
    def max_measured_concurrency(self) -> float:
        # A single point says nothing about saturation, so it does not cap concurrency.
        return math.inf if len(self.points) == 1 else self.points[-1].concurrency

    def per_stream_rate(self, concurrency: float) -> float:
        pts = self.points
        if concurrency <= pts[0].concurrency:
            return pts[0].per_stream_tokens_per_s
        last = pts[-1]
        if concurrency >= last.concurrency:
            if len(pts) == 1:
                return last.per_stream_tokens_per_s
            return last.per_stream_tokens_per_s * last.concurrency / concurrency
        i = bisect_right([p.concurrency for p in pts], concurrency)
        lo, hi = pts[i - 1], pts[i]
        frac = (concurrency - lo.concurrency) / (hi.concurrency - lo.concurrency)
        return lo.per_stream_tokens_per_s + frac * (hi.per_stream_tokens_per_s - lo.per_stream_tokens_per_s)

    def aggregate_rate(self, concurrency: float) -> float:
        return concurrency * self.per_stream_rate(concurrency)

    def ttft(self, concurrency: float) -> float:
        known = [(p.concurrency, p.ttft_s) for p in self.points if p.ttft_s is not None]
        if not known:
            return self.ttft_s
        if concurrency <= known[0][0]:
            return known[0][1]
        if concurrency >= known[-1][0]:
            return known[-1][1]
        i = bisect_right([c for c, _ in known], concurrency)
        (c0, t0), (c1, t1) = known[i - 1], known[i]
        return t0 + (concurrency - c0) / (c1 - c0) * (t1 - t0)

    def ttft_for(self, concurrency: float, prompt_tokens: int) -> float:
        """TTFT for a prompt of this length: the measured figure moved by the extra prefill."""
        extra = (prompt_tokens - self.prompt_ref_tokens) / self.prefill_tokens_per_s
        return max(0.0, self.ttft(concurrency) + extra)

    def request_seconds(
        self, concurrency: float, output_tokens: int, prompt_tokens: int | None = None
    ) -> float:
        """Wall time of one request when `concurrency` streams share the replica."""
        first = self.ttft(concurrency) if prompt_tokens is None else self.ttft_for(concurrency, prompt_tokens)
        return first + output_tokens / self.per_stream_rate(concurrency)


def parse_curve(text: str) -> list[ThroughputPoint]:
    """Parse ``"1:500,8:400,32:250"`` (concurrency:per-stream tokens/s) into points."""
    items = text.split(",")
    if len(items) > MAX_CURVE_POINTS:
        raise CostModelError(f"--throughput takes at most {MAX_CURVE_POINTS} points, got {len(items)}")
    points = []
    for item in items:
        parts = item.strip().split(":")
        if len(parts) != 2:
            raise CostModelError(f"bad --throughput item '{item.strip()}': expected CONCURRENCY:TOKENS_PER_S")
        try:
            conc, rate = float(parts[0]), float(parts[1])
        except ValueError:
            raise CostModelError(f"bad --throughput item '{item.strip()}': not numbers") from None
        if not (1 <= conc <= 1024 and 0 < rate <= 1e6):  # also false for NaN
            raise CostModelError(
                f"bad --throughput item '{item.strip()}': concurrency within 1..1024, rate within 0..1e6 tok/s"
            )
        points.append(ThroughputPoint(concurrency=conc, per_stream_tokens_per_s=rate))
    return sorted(points, key=lambda p: p.concurrency)


def from_flags(
    tokens_per_s: float | None,
    curve: str | None,
    ttft_s: float,
    cold_start_s: float,
    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S,
    cold_start_source: str = "given",
) -> ServiceProfile:
    """Build a profile from command-line numbers."""
    if ttft_s < 0 or cold_start_s < 0:
        raise CostModelError("--ttft and --cold-start must be >= 0 seconds")
    if curve:
        points = parse_curve(curve)
    elif tokens_per_s is not None:
        if tokens_per_s <= 0:
            raise CostModelError("--tokens-per-s must be > 0")
        points = [ThroughputPoint(concurrency=1, per_stream_tokens_per_s=tokens_per_s)]
    else:
        raise CostModelError("give the service speed: --bench FILE, --tokens-per-s N or --throughput C:N,...")
    try:
        return ServiceProfile(
            points=tuple(points),
            ttft_s=ttft_s,
            cold_start_s=cold_start_s,
            prefill_tokens_per_s=prefill_tokens_per_s,
            cold_start_source=cold_start_source,
        )
    except ValueError as exc:
        raise CostModelError(f"bad throughput curve: {exc}") from None
