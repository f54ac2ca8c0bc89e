"""coglet's internals that the Cog runner relies on, reached from nowhere else, and their check
against the installed coglet (pinned 0.23.1: pyproject's `cog` extra, cog.yaml's Cog CLI).

What is used (cog/cog_cancel.py says why):
- coglet's worker submits each async run() with `asyncio.run_coroutine_threadsafe`, looked up
  on the asyncio module at call time, so the runner's cancel hook can take its place;
- what it submits is its own wrapper around run(), `_ctx_wrapper(coro, prediction_id, ...)`, a
  Python function defined from source inside coglet's Rust extension: a run is told from any
  other submission by the wrapper's name, run()'s own coroutine is the wrapper's local `coro`
  (closed when the run never started), and the prediction's id its local `prediction_id`.

`detect` checks them once, when the runner starts (cog/predict.py's `setup`), as
shared/engine/vllm_features.py checks vLLM: the wrapper exists before the first prediction only
as source text in the extension, so that is where it is looked for. A coglet without it is a
`fallback`: no submission is taken for a run, and a cancel then leaves the engine request to
run to its end (cog_cancel warns again at the first prediction). Logged in one line and shown
in the service's metrics as `bundle_server_features` (shared/obs/internals_check.py).
"""

from __future__ import annotations

import importlib
import logging
import mmap
from collections.abc import Coroutine
from importlib import metadata
from pathlib import Path
from typing import Any

from shared.obs.internals_check import Found, InternalsCheck, log_check

log = logging.getLogger(__name__)

RUN_WRAPPER = "_ctx_wrapper"  # coglet 0.23.1's coroutine around run(), submitted per prediction
# Its definition as the extension carries it: the name and the two locals read below.
RUN_WRAPPER_SOURCE = b"async def _ctx_wrapper(coro, prediction_id,"
SUBMIT_FUNCTION = b"run_coroutine_threadsafe"  # the asyncio function the worker looks up


# --- a submission, read ------------------------------------------------------------------------------
def is_run(coro: object) -> bool:
    """Whether coglet is submitting a run() (its wrapper), not some other coroutine."""
    return getattr(getattr(coro, "cr_code", None), "co_name", None) == RUN_WRAPPER


def _wrapper_local(wrapper: object, name: str) -> Any:
    frame = getattr(wrapper, "cr_frame", None)  # None once the wrapper has finished
    return frame.f_locals.get(name) if frame is not None else None


def wrapped_run(wrapper: object) -> Coroutine[Any, Any, Any] | None:
    """run()'s own coroutine inside coglet's wrapper; None where it cannot be found."""
    inner = _wrapper_local(wrapper, "coro")
    return inner if isinstance(inner, Coroutine) else None


def prediction_id(wrapper: object) -> str | None:
    """The id of the prediction a run() wrapper was submitted for (tests hold runs by it)."""
    value = _wrapper_local(wrapper, "prediction_id")
    return str(value) if value else None


# --- the check --------------------------------------------------------------------------------------
def extension_path() -> Path:
    """coglet's Rust extension, where its worker's Python source lives."""
    return Path(str(importlib.import_module("coglet._impl").__file__))


def _carries(path: Path, *texts: bytes) -> dict[bytes, bool]:
    """Which of `texts` the file holds, read through a map (the extension is ~16 MB)."""
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as image:
        return {text: image.find(text) >= 0 for text in texts}


def _coglet(feature: str, found: bool, path: str, fallback: str) -> Found:
    if found:
        return Found("coglet", feature, path, "expected")
    return Found("coglet", feature, fallback, "fallback")


def detect(*, hook_installed: bool) -> InternalsCheck:
    """Every use, on the installed coglet; `hook_installed`: whether cog_cancel's hook took the
    place of asyncio.run_coroutine_threadsafe (False: something else had replaced it first)."""
    carried = _carries(extension_path(), RUN_WRAPPER_SOURCE, SUBMIT_FUNCTION)
    found = (
        _coglet("run_submit", carried[SUBMIT_FUNCTION], "run_coroutine_threadsafe", "unknown"),
        _coglet("run_wrapper", carried[RUN_WRAPPER_SOURCE], RUN_WRAPPER, "unknown"),
        _coglet("cancel_hook", hook_installed, "installed", "not_installed"),
    )
    return InternalsCheck((f"coglet {metadata.version('coglet')}",), found)


def log_found(check: InternalsCheck) -> None:
    log_check(log, "coglet internals", check)
