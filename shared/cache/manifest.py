"""A pack's description of itself: what its caches are valid for, and every file they hold.

`valid_for` is the key of the start that filled the caches (shared/cache/key.py). A pack is used
only by a start whose key is equal in every field. The key is the first gate, not the only
one: vLLM, inductor and Triton name their own entries by hashes of what they compiled for, so a
factor the key does not list costs a recompile, never a wrong kernel. `files` lists each file
with its size and SHA-256: a pack cut short or damaged in transit is refused whole.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

SCHEMA = "bundle-compile-cache/1"
MANIFEST_NAME = "manifest.json"
CACHES_DIR = "caches"  # the root's contents, inside a pack
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
MAX_SHOWN_DIFFERENCES = 4


class StartKey(BaseModel):
    """What a start's caches depend on (every field must match for a pack to be used)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    device: str  # "NVIDIA H200", or "cpu: <model name>"
    compute_capability: str | None  # "9.0"; None on CPU
    python: str  # "3.12"
    packages: dict[str, str | None]  # vllm, torch, triton, flashinfer: installed versions
    model: str  # the path or id vLLM was given: part of vLLM's own cache key
    model_config_sha256: str | None  # of its config.json, when it is a local folder
    engine: dict[str, Any]  # the engine arguments that key vLLM's compile cache
    root: str  # where the caches lived: compiled artifacts may name their own paths


class PackedFile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    path: str  # relative to the root, '/'-separated
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class Manifest(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)
    schema_: Literal["bundle-compile-cache/1"] = Field("bundle-compile-cache/1", alias="schema")
    created: str
    valid_for: StartKey
    files: tuple[PackedFile, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def dump(self) -> bytes:
        return self.model_dump_json(by_alias=True, indent=2).encode()


def differences(pack: StartKey, here: StartKey) -> list[str]:
    """Each field where the pack's key and this start's differ, as 'name: pack X, here Y'."""
    found: list[str] = []
    ours, theirs = here.model_dump(), pack.model_dump()
    for name, value in theirs.items():
        mine = ours[name]
        if isinstance(value, dict) and isinstance(mine, dict):
            for part in sorted(set(value) | set(mine)):
                if value.get(part) != mine.get(part):
                    found.append(f"{name}.{part}: pack {value.get(part)!r}, here {mine.get(part)!r}")
        elif value != mine:
            found.append(f"{name}: pack {value!r}, here {mine!r}")
    return found


def describe_differences(found: list[str]) -> str:
    """The first few differences, for one log line."""
    shown = "; ".join(found[:MAX_SHOWN_DIFFERENCES])
    more = len(found) - MAX_SHOWN_DIFFERENCES
    return shown + (f"; and {more} more" if more > 0 else "")
