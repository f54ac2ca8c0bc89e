"""A Cog runner whose setup forks a child that starts the way vLLM 0.26's engine core does.

tests/test_cog_boot.py runs it under the real coglet. It loads the bundle's real runner module
(cog/predict.py) first, exactly as coglet would, so whatever that module does for forked
children is in force; then `setup()` forks (multiprocessing's fork context, vLLM's default on
GPUs) a child that:
1. decorates stdout/stderr as vLLM 0.26's `decorate_logs()` does in its engine core (sets
   attributes on the stream objects and wraps their `write`), the step that raised
   AttributeError on coglet's stream objects and killed the core on the H200;
2. writes through a logging handler made in the parent on `sys.stdout` (vLLM's handler is
   built that way at import), through print(), and dies with an exception: its traceback.
The parent then fails setup, as vLLM does when its core dies. Every line the child wrote must
be in coglet's log.
"""

from __future__ import annotations

import importlib.util
import logging
import multiprocessing
import sys
import time
from collections.abc import Callable
from pathlib import Path

from cog import BaseRunner

MARKER = "child-marker-7f3a"
# Coglet may report the setup failure before its capture threads forwarded the child's last
# lines; a real engine takes longer than this between its core's death and the failure.
SETTLE_S = 0.5

_spec = importlib.util.spec_from_file_location(
    "bundle_cog_predict", Path(__file__).resolve().parent.parent / "cog" / "predict.py"
)
assert _spec is not None and _spec.loader is not None
_spec.loader.exec_module(importlib.util.module_from_spec(_spec))

log = logging.getLogger("fork_runner")
_handler = logging.StreamHandler(sys.stdout)  # the object coglet installed, as vLLM's handler
log.addHandler(_handler)
log.setLevel(logging.INFO)
log.propagate = False


def _decorate(stream: object, name: str) -> None:
    """What vLLM 0.26's decorate_logs() does to a stream, in short."""
    original: Callable[[str], object] = stream.write  # type: ignore[attr-defined]

    def write(text: str) -> object:
        return original(f"({name}) {text}" if text.strip() else text)

    stream.start_new_line = True  # type: ignore[attr-defined]
    stream._original_write = original  # type: ignore[attr-defined]
    stream.write = write  # type: ignore[attr-defined]


def _child() -> None:
    _decorate(sys.stdout, "EngineCore")
    _decorate(sys.stderr, "EngineCore")
    log.error("%s via the logging handler", MARKER)
    print(f"{MARKER} via print", flush=True)
    raise RuntimeError(f"{MARKER} failing on purpose")


class Runner(BaseRunner):
    def setup(self) -> None:
        try:
            sys.stdout.probe = True  # type: ignore[attr-defined]
        except AttributeError as exc:
            print(f"coglet's sys.stdout takes no attributes: {type(exc).__name__}: {exc}", flush=True)
        child = multiprocessing.get_context("fork").Process(target=_child, name="EngineCore")
        child.start()
        child.join(30)
        time.sleep(SETTLE_S)
        raise RuntimeError(f"the forked child exited with {child.exitcode}")

    def run(self) -> str:
        return "never served"
