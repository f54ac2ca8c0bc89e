"""The traffic a deployment must serve, split into segments of constant arrival rate."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cost_model.constants import HOURS_PER_DAY, SECONDS_PER_HOUR


class Arrival(str, Enum):  # noqa: UP042 (StrEnum would change how values print)
    STEADY = "steady"  # evenly spaced requests: every gap is exactly 1/rate
    POISSON = "poisson"  # independent arrivals: gaps are exponential
    PEAK = "peak"  # Poisson, but `peak_hours` a day run at `peak_factor` x the mean rate


@dataclass(frozen=True)
class Segment:
    """A part of the day with one arrival rate."""

    hours: float
    rate_per_s: float
    poisson: bool

    @property
    def seconds(self) -> float:
        return self.hours * SECONDS_PER_HOUR


class Workload(BaseModel):
    """Requests per day, how they arrive, and how big each one is."""

    model_config = ConfigDict(frozen=True, allow_inf_nan=False)
    requests_per_day: Annotated[float, Field(gt=0)]
    arrival: Arrival = Arrival.POISSON
    peak_factor: Annotated[float, Field(ge=1)] = 3.0
    peak_hours: Annotated[float, Field(gt=0, le=24)] = 4.0
    prompt_tokens: Annotated[int, Field(ge=0)] = 200
    output_tokens: Annotated[int, Field(gt=0)] = 500

    @model_validator(mode="after")
    def _peak_fits_in_day(self) -> Workload:
        # The peak hours alone must not need more than the whole day's requests.
        if self.arrival is Arrival.PEAK and self.peak_factor * self.peak_hours > HOURS_PER_DAY:
            raise ValueError(
                f"peak factor {self.peak_factor} x {self.peak_hours} peak hours exceeds 24 h of traffic"
            )
        return self

    @property
    def mean_rate_per_s(self) -> float:
        return self.requests_per_day / (HOURS_PER_DAY * SECONDS_PER_HOUR)

    def with_rate(self, requests_per_day: float) -> Workload:
        return self.model_copy(update={"requests_per_day": requests_per_day})

    def segments(self) -> list[Segment]:
        mean = self.mean_rate_per_s
        if self.arrival is Arrival.STEADY:
            return [Segment(HOURS_PER_DAY, mean, poisson=False)]
        if self.arrival is Arrival.POISSON or self.peak_hours >= HOURS_PER_DAY:
            return [Segment(HOURS_PER_DAY, mean, poisson=True)]
        return self._peak_segments(mean)

    def _peak_segments(self, mean: float) -> list[Segment]:
        # Conserve the day's volume: peak_rate*H + off_rate*(24-H) == mean*24.
        off_hours = HOURS_PER_DAY - self.peak_hours
        peak = self.peak_factor * mean
        off = mean * (HOURS_PER_DAY - self.peak_factor * self.peak_hours) / off_hours
        return [Segment(self.peak_hours, peak, True), Segment(off_hours, off, True)]
