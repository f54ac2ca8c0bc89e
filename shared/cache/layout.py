"""The one folder a start's compile caches live in, and the record of the start that used it.

vLLM keeps its torch.compile artifacts, model-class info (`modelinfos`) and FlashInfer tuning
under `VLLM_CACHE_ROOT`; inductor, Triton and FlashInfer's own kernels have folders of their own
(/tmp, ~/.triton, ~/.cache/flashinfer by default). Pointed at one root, all of them can be kept
together (Modal's volume) or packed and shipped (Replicate). The root also holds
`bundle-start.json`, the key of the last start that used it (shared/cache/key.py): what
`python -m shared.cache pack` writes into a pack's manifest, and what tells a start that its
root already holds caches like the ones a pack would bring.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from pydantic import ValidationError

from shared.cache.manifest import StartKey
from shared.settings import Settings

log = logging.getLogger(__name__)

ROOT_NAME = "compile-cache"  # under BUNDLE_CACHE_DIR when BUNDLE_COMPILE_CACHE_DIR is unset
RECORD = "bundle-start.json"
RECORD_SCHEMA = "bundle-compile-cache-start/1"


def cache_env(root: Path | str) -> dict[str, str]:
    """The environment that puts every cache an engine start fills under `root`."""
    return {
        "VLLM_CACHE_ROOT": str(root),
        "TORCHINDUCTOR_CACHE_DIR": f"{root}/inductor",
        "TRITON_CACHE_DIR": f"{root}/triton",
        # FlashInfer's JIT-built kernels and downloaded cubins (<base>/.cache/flashinfer/...);
        # vLLM puts FlashInfer's autotuning results under VLLM_CACHE_ROOT itself.
        "FLASHINFER_WORKSPACE_BASE": f"{root}/flashinfer",
    }


def managed_root(settings: Settings) -> Path | None:
    """The root these settings keep their caches in; None: the caches' own defaults apply."""
    if settings.compile_cache_dir is not None:
        return settings.compile_cache_dir
    if settings.compile_cache is not None:
        return settings.cache_dir / ROOT_NAME
    return None


def with_default_root(settings: Settings) -> Settings:
    """These settings with a root even without a pack (<cache_dir>/compile-cache), so that a
    container's start can be packed afterwards from a known place (the Cog runner does this)."""
    if settings.compile_cache_dir is not None:
        return settings
    return settings.model_copy(update={"compile_cache_dir": settings.cache_dir / ROOT_NAME})


def point_caches_at(settings: Settings) -> Path | None:
    """Set the caches' variables for this process (and the engine processes it starts) to the
    settings' root, before anything reads them; the root, or None when the settings keep none.
    vLLM, inductor and Triton read these variables when they first need a cache, not at import."""
    root = managed_root(settings)
    if root is not None:
        os.environ.update(cache_env(root))
    return root


def read_record(root: Path) -> StartKey | None:
    """The key of the last start that used `root`; None when there is none (or it is unreadable)."""
    try:
        data = json.loads((root / RECORD).read_text())
        if data.get("schema") != RECORD_SCHEMA:
            return None
        return StartKey.model_validate(data["key"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError, ValidationError):
        return None


def write_record(root: Path, key: StartKey) -> None:
    """Record `key` as the start using `root` (atomic: whole or absent)."""
    root.mkdir(parents=True, exist_ok=True)
    pending = root / f"{RECORD}.tmp"
    pending.write_text(json.dumps({"schema": RECORD_SCHEMA, "key": key.model_dump()}, indent=2))
    os.replace(pending, root / RECORD)
