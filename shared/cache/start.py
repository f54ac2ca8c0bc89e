"""What an engine start does with compile caches: the one call before vLLM's engine starts.

    use_compile_caches(settings, engine_args)   # shared/engine/vllm_startup.py, start_llm

With a root (BUNDLE_COMPILE_CACHE_DIR, or a pack given: shared/cache/layout.py) it points the
caches at it, unpacks the pack (BUNDLE_COMPILE_CACHE) if it was made for this very start, and
records this start's key in the root, for `python -m shared.cache pack` to put in a pack later.
A pack never makes a start fail: whatever is wrong with it is one log line saying why it was not
used, and the start goes on as it would without it (filling the caches itself).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from shared.cache.fetch import local_pack
from shared.cache.key import start_key
from shared.cache.layout import point_caches_at, read_record, write_record
from shared.cache.manifest import StartKey
from shared.cache.pack import unpack_into
from shared.errors import CompileCacheRefused
from shared.settings import Settings

log = logging.getLogger(__name__)
MIB = 1024 * 1024
NOT_USED = "compile-cache pack %s: not used, %s; starting without it"


def use_compile_caches(settings: Settings, engine_args: Any) -> StartKey | None:
    """Point the caches at the settings' root, apply the settings' pack where it matches, record
    this start's key; the key, or None when these settings keep no root. Never raises for the
    pack or the bookkeeping: a start without them is a start as it always was."""
    root = point_caches_at(settings)
    if root is None:
        return None
    try:
        here = start_key(engine_args, root)
    except Exception as exc:
        log.warning(NOT_USED, settings.compile_cache, f"this start's key cannot be read: {_said(exc)}")
        return None
    if settings.compile_cache is not None:
        apply_pack(settings.compile_cache, settings.cache_dir, root, here)
    try:
        write_record(root, here)
    except OSError as exc:
        log.warning("compile caches: this start cannot be recorded in %s (%s), so not packed later", root, exc)
    return here


def fetch_pack(settings: Settings) -> Path | None:
    """The settings' pack on this disk (a URL downloaded), or None: none set, or it cannot be
    had (said in one line, as for a pack that does not match)."""
    if settings.compile_cache is None:
        return None
    try:
        return local_pack(settings.compile_cache, settings.cache_dir)
    except CompileCacheRefused as exc:
        log.warning(NOT_USED, settings.compile_cache, exc.message)
    except Exception as exc:  # a pack must never make a start fail, whatever went wrong
        log.warning(NOT_USED, settings.compile_cache, _said(exc))
    return None


def apply_pack(source: str, cache_dir: Path, root: Path, here: StartKey) -> bool:
    """Unpack the pack `source` names into `root` if it was made for `here`; whether it was.
    Logs exactly one line either way."""
    if read_record(root) == here:
        log.info("compile-cache pack %s: not needed, %s already holds this same start's caches", source, root)
        return False
    try:
        done = unpack_into(local_pack(source, cache_dir), root, here)
    except CompileCacheRefused as exc:
        log.warning(NOT_USED, source, exc.message)
        return False
    except Exception as exc:  # a pack must never make a start fail, whatever went wrong
        log.warning(NOT_USED, source, _said(exc))
        return False
    log.info(
        "compile-cache pack %s: used, %d files (%.1f MiB, %d new) unpacked into %s in %.2f s",
        source,
        done.files,
        done.bytes / MIB,
        done.new_files,
        root,
        done.seconds,
    )
    return True


def _said(exc: BaseException) -> str:
    return f"unexpected {type(exc).__name__}: {exc}"
