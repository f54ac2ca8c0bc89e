"""vLLM's inspection of the served model class, run early and beside the import, not late in the start.

When vLLM's engine configuration is built it asks its model registry what the served
architecture's class supports. Unless `VLLM_CACHE_ROOT/modelinfos/` already holds the answer for
this vLLM's model module, the registry starts a fresh Python that imports vLLM again to find out,
and the start waits for it: the `model_config` phase of an empty container's boot, 17-19 s on
the H200 (results/h200/coldboot/) and 14-25 s on the 2-core CPU box (results/cpu/coldboot/).
The answer depends on vLLM's model module only, not on the GPU or the weights, so it can be had as
soon as the model's `config.json` names its architectures, in a process of its own that runs
while this one imports vLLM and downloads the weights:

    begin_inspection(model_dir)   # after point_caches_at(): the cache root vLLM will read
    ...                            # import vLLM, download the weights and the pack
    settle_inspection()            # shared/engine/vllm_startup.py, after the pack, before the engine

The child (`inspect_in_this_process`, in a fresh interpreter) is the fresh process vLLM would
have started: it has the registry inspect each class in-process and save vLLM's own cache file,
in a scratch cache root of its own. Settling moves that file into the root the engine reads,
waiting for the child if it still runs (never longer than the engine's own inspection would
take, as it started earlier). Where the root already holds an answer, a compile-cache pack
brought it: the pack's file stays as it is and the child is stopped. Anything going wrong here
(no config.json, an architecture vLLM does not list, a child that fails) is one log line, and
the engine inspects the class itself as it always did.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

ANSWERS = "modelinfos"  # vLLM's folder of inspection answers under its cache root
WAIT_LIMIT_S = 180.0  # an inspection on a loaded 2-core box took 25 s; this only bounds a hang
# The child imports this module from the same copy of the package as this process (a Cog
# runner's /src, a wheel, a checkout), whatever its working directory and sys.path.
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
CHILD = (
    "import sys; sys.path.insert(0, sys.argv[1]); "
    "from shared.engine.model_inspection import inspect_in_this_process; "
    "inspect_in_this_process(sys.argv[2:])"
)


@dataclass
class Inspection:
    architectures: list[str]
    process: subprocess.Popen[bytes]
    stderr: IO[bytes]  # a file, not a pipe: a child writing more than a pipe holds never blocks
    scratch: Path  # the child's own VLLM_CACHE_ROOT: it never writes where the engine reads
    started: float

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.stderr.close()
        shutil.rmtree(self.scratch, ignore_errors=True)


# The one early inspection of this process, begun by its start's preparation and settled by the
# engine start that follows (both run once per engine; the next begin replaces a stale one).
_pending: list[Inspection] = []


def begin_inspection(model: str | Path) -> None:
    """Start inspecting the classes `model`'s config.json names, for the next engine start,
    unless vLLM's cache already holds an answer for each (a warm root: nothing to wait for)."""
    _discard_pending()
    architectures = _architectures(Path(model))
    if not architectures or _cached(architectures, cache_root()):
        return
    inspection = start_inspection(architectures)
    if inspection is not None:
        _pending.append(inspection)


def settle_inspection() -> None:
    """Settle the inspection begun for this start, if any, against the cache vLLM reads."""
    if _pending:
        settle(_pending.pop(), cache_root())


def cache_root() -> Path:
    """The folder vLLM keeps its caches in, as its `envs.VLLM_CACHE_ROOT` reads it."""
    if os.environ.get("VLLM_CACHE_ROOT"):
        return Path(os.environ["VLLM_CACHE_ROOT"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "vllm"


def _discard_pending() -> None:
    while _pending:
        _pending.pop().close()


def start_inspection(architectures: list[str]) -> Inspection | None:
    """A fresh interpreter inspecting these classes into a scratch cache root of its own; None
    (and a line) if it cannot start."""
    scratch = Path(tempfile.mkdtemp(prefix="bundle-model-inspection-"))
    stderr = tempfile.TemporaryFile()  # noqa: SIM115 - Inspection.close() closes it
    try:
        process = subprocess.Popen(
            [sys.executable, "-c", CHILD, PACKAGE_ROOT, *architectures],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env={**os.environ, "VLLM_CACHE_ROOT": str(scratch)},
        )
    except OSError as exc:
        stderr.close()
        shutil.rmtree(scratch, ignore_errors=True)
        log.warning("model inspection: could not start it early (%s); the engine will do it", exc)
        return None
    return Inspection(architectures, process, stderr, scratch, time.monotonic())


def settle(inspection: Inspection, root: Path) -> None:
    """Put the early inspection's answer where vLLM reads it, waiting for it if need be; unless
    the cache already answers for every architecture (a compile-cache pack brought the answer,
    which stays as the pack made it): then the child is stopped, not waited for."""
    try:
        if _cached(inspection.architectures, root):
            log.info("model inspection: %s already in the cache; the early one stopped", _names(inspection))
            return
        waited = time.monotonic()
        try:
            inspection.process.wait(timeout=WAIT_LIMIT_S)
        except subprocess.TimeoutExpired:
            log.warning("model inspection: the early one took over %.0f s and was stopped", WAIT_LIMIT_S)
            return
        if inspection.process.returncode != 0:
            log.warning(
                "model inspection: the early one failed (exit %s: %s); the engine will do it",
                inspection.process.returncode,
                _last_line(inspection.stderr),
            )
            return
        moved = _move_answers(inspection.scratch, root)
        log.info(
            "model inspection: %s done early in %.1f s, %.1f s of it waited for (%d file(s) into %s)",
            _names(inspection),
            time.monotonic() - inspection.started,
            time.monotonic() - waited,
            moved,
            root / ANSWERS,
        )
    except OSError as exc:  # an unwritable cache: the engine inspects and finds out itself
        log.warning("model inspection: its answer could not be kept (%s); the engine will do it", exc)
    finally:
        inspection.close()


def _move_answers(scratch: Path, root: Path) -> int:
    """Each of the child's answer files into `root`, whole or not at all (rename in one folder)."""
    target = root / ANSWERS
    target.mkdir(parents=True, exist_ok=True)
    answers = sorted((scratch / ANSWERS).glob("*.json"))
    for answer in answers:
        staged = target / f".{answer.name}.{os.getpid()}"
        shutil.copyfile(answer, staged)
        os.replace(staged, target / answer.name)
    return len(answers)


def _architectures(model: Path) -> list[str]:
    try:
        config = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return []
    names = config.get("architectures") if isinstance(config, dict) else None
    if not isinstance(names, list):
        return []
    return [name for name in names if isinstance(name, str) and name.isidentifier()]


def _cached(architectures: list[str], root: Path) -> bool:
    # vLLM names the file "<module with dashes>-<class>.json" (registry._LazyRegisteredModel);
    # one whose module hash is stale is re-inspected by the engine itself, as before.
    folder = root / ANSWERS
    return all(any(folder.glob(f"*-{name}.json")) for name in architectures)


def _names(inspection: Inspection) -> str:
    return ", ".join(inspection.architectures)


def _last_line(stderr: IO[bytes]) -> str:
    stderr.seek(0)
    lines = [line for line in stderr.read().decode(errors="replace").splitlines() if line.strip()]
    return lines[-1][-300:] if lines else "no output"


def _run_here(work: Callable[[], T]) -> T:
    return work()


def inspect_in_this_process(architectures: list[str]) -> None:
    """The child: inspect each class here and let vLLM save its cache file. This process is the
    fresh one vLLM would have started, so its registry is told not to start another one; where
    a vLLM release lacks that hook, the registry starts it anyway (slower, still right)."""
    from vllm.model_executor.models import registry

    if hasattr(registry, "_run_in_subprocess"):
        registry._run_in_subprocess = _run_here  # type: ignore[assignment]
    for name in architectures:
        model = registry.ModelRegistry.models.get(name)
        if model is None:
            print(f"{name}: not an architecture this vLLM lists", file=sys.stderr)
            continue
        model.inspect_model_cls()
