"""Load, validate and merge the price catalogue (the packaged JSON plus user overrides)."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cost_model.errors import CostModelError
from cost_model.inputfile import read_text
from cost_model.limits import BOUNDS

PACKAGED = "data/catalogue.json"
NonNegative = Annotated[float, Field(ge=0, le=1e6)]  # bounded: prices and windows, never inf
Positive = Annotated[float, Field(gt=0, le=1e6)]
# The command line's bounds hold for a catalogue file too: an unbounded minimum or concurrency
# would size the simulation's pool (10^9 minimum containers never finishes).
MinContainers = Annotated[int, Field(ge=0, le=int(BOUNDS["min-containers"][1]))]
Concurrency = Annotated[int, Field(ge=1, le=int(BOUNDS["concurrency"][1]))]


class BillingRules(BaseModel):
    """What a platform bills and how its autoscaler behaves."""

    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)
    description: str = ""
    bills_setup: bool
    bills_idle: bool
    scaledown_window_s: NonNegative
    min_containers: MinContainers = 0
    concurrency_per_replica: Concurrency = 1
    cpu_usd_per_core_second: NonNegative = 0.0
    memory_usd_per_gib_second: NonNegative = 0.0
    source: str = ""
    read_on: str = ""
    note: str = ""


class _EntryBase(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)
    id: Annotated[str, Field(min_length=1)]
    platform: Annotated[str, Field(min_length=1)]
    source: Annotated[str, Field(min_length=1)]
    read_on: Annotated[str, Field(pattern=r"^\d{4}-\d{2}-\d{2}$")]
    note: str = ""


class PerSecondEntry(_EntryBase):
    kind: Literal["per_second"]
    gpu: str
    usd_per_second: Positive
    # Minimum containers billed at another rate (RunPod "active" workers); None: the same rate.
    usd_per_second_min_container: Positive | None = None


class ReservedEntry(_EntryBase):
    kind: Literal["reserved_hourly"]
    gpu: str
    usd_per_hour: Positive


class PerTokenEntry(_EntryBase):
    kind: Literal["per_token"]
    model: str = ""
    model_params_b: Annotated[float, Field(gt=0)] | None = None  # the model size this price is for
    usd_per_million_input: NonNegative
    usd_per_million_output: NonNegative


class PerRequestEntry(_EntryBase):
    kind: Literal["per_request"]
    model: str = ""
    usd_per_request: Positive


Entry = Annotated[PerSecondEntry | ReservedEntry | PerTokenEntry | PerRequestEntry, Field(discriminator="kind")]
GPU_KINDS = ("per_second", "reserved_hourly")


class Catalogue(BaseModel):
    """The whole price list: billing rules per platform and priced entries."""

    model_config = ConfigDict(extra="ignore")
    schema_: str = Field(default="cost-catalogue/1", alias="schema")
    platforms: dict[str, BillingRules] = Field(default_factory=dict)
    entries: list[Entry] = Field(default_factory=list)

    def entry(self, entry_id: str) -> Entry:
        for item in self.entries:
            if item.id == entry_id:
                return item
        raise CostModelError(f"unknown catalogue entry '{entry_id}' (see: python -m cost_model catalogue)")

    def pick(self, text: str) -> list[Entry]:
        """Entries named in a comma-separated list: at least one, each known, none twice."""
        names = [n.strip() for n in text.split(",") if n.strip()]  # a trailing comma is harmless
        if not names:
            raise CostModelError("--entries needs at least one catalogue id, e.g. --entries modal-h100")
        known = [e.id for e in self.entries]
        for i, name in enumerate(names):
            if name not in known:
                raise CostModelError(f"--entries: unknown entry '{name}' (valid: {', '.join(known)})")
            if name in names[:i]:
                raise CostModelError(f"--entries names '{name}' twice")
        return [self.entry(n) for n in names]

    def rules_for(self, entry: Entry) -> BillingRules:
        try:
            return self.platforms[entry.platform]
        except KeyError:
            raise CostModelError(
                f"entry '{entry.id}' names platform '{entry.platform}' that the catalogue does not define"
            ) from None

    def gpus(self) -> list[str]:
        return sorted({e.gpu for e in self.entries if e.kind in GPU_KINDS})  # type: ignore[union-attr]


def _validate(raw: object, origin: str) -> Catalogue:
    try:
        cat = Catalogue.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise CostModelError(f"malformed catalogue {origin}: {where}: {first['msg']}") from None
    for entry in cat.entries:
        if entry.platform not in cat.platforms:
            raise CostModelError(
                f"malformed catalogue {origin}: entry '{entry.id}' uses undefined platform '{entry.platform}'"
            )
    return cat


def _read_json(path: Path) -> object:
    text = read_text(path, "catalogue")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise CostModelError(f"malformed catalogue {path}: invalid JSON at line {exc.lineno}") from None
    except (ValueError, RecursionError) as exc:
        raise CostModelError(f"cannot read catalogue file {path}: {str(exc).splitlines()[0]}") from None


def load_packaged() -> Catalogue:
    """The catalogue shipped with the package."""
    text = resources.files("cost_model").joinpath(PACKAGED).read_text(encoding="utf-8")
    return _validate(json.loads(text), "(packaged)")


def merge(base: Catalogue, extra: Catalogue) -> Catalogue:
    """Entries and platforms in ``extra`` replace same-named ones in ``base``; new ones are added."""
    platforms = {**base.platforms, **extra.platforms}
    replaced = {e.id for e in extra.entries}
    entries = [e for e in base.entries if e.id not in replaced] + list(extra.entries)
    return _validate(
        {
            "platforms": {k: v.model_dump() for k, v in platforms.items()},
            "entries": [e.model_dump() for e in entries],
        },
        "(merged)",
    )


def load_override(path: Path, base: Catalogue) -> Catalogue:
    """Read a user catalogue file; it may define only some platforms and entries."""
    raw = _read_json(path)
    if not isinstance(raw, dict):
        raise CostModelError(f"malformed catalogue {path}: top level must be a JSON object")
    # A user file may refer to platforms defined only in the base catalogue.
    platforms = {k: v.model_dump() for k, v in base.platforms.items()}
    extra_platforms = raw.get("platforms")
    extra_platforms = {} if extra_platforms is None else extra_platforms
    if not isinstance(extra_platforms, dict):
        raise CostModelError(f"malformed catalogue {path}: 'platforms' must be an object")
    platforms.update(extra_platforms)
    extra = _validate({"platforms": platforms, "entries": raw.get("entries", [])}, str(path))
    return merge(base, extra)


def add_entry(cat: Catalogue, raw_entry: dict[str, object]) -> Catalogue:
    """Add or replace one entry given as a plain dict (used by command-line price flags)."""
    extra = _validate(
        {
            "platforms": {k: v.model_dump() for k, v in cat.platforms.items()},
            "entries": [raw_entry],
        },
        "(command line)",
    )
    return merge(cat, extra)
