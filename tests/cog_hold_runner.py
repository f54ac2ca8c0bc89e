"""The real Cog runner (cog/predict.py) with holds a test controls, for tests under the real coglet.

A prediction the test did not mark runs exactly as under cog/predict.py. A test marks one by
writing files named after its prediction id in the folder COG_TEST_HOLD_DIR before sending it:

- `<id>.budget`: how many of the engine's outputs that carry text its generation may pass on
  (re-read while it waits; write a larger number to release more). The generation stays in the
  engine, held, until then: a test that needs a stream still running holds it instead of racing
  the engine. An output without text (a token that decodes to nothing yet) is not counted.
- `<id>.hold`: where run() waits until the prediction's cancel has arrived (the cancel windows of
  cog/cog_cancel.py, made deterministic):
  - `submit`: in the slot thread, right after coglet submitted run() and before it waits on it,
    in a Python loop, so coglet's CancelationException is injected and raised there;
  - `open`: on the loop, inside the service's `open` after the generation is opened (or joined),
    waiting until the cancel signal fired, its waits cancellable as any await of run()'s;
  - `return`: after `start_generation`, waiting for the signal and ignoring the task's cancel, so
    run() returns its generator after coglet cancelled it.

- the subfolder `gate/` (GATE_FOLDER) is a test gate's control folder (tests/gate.py): the engine
  is wrapped in `GatedEngine`, so a test holds a generation by a word in its prompt through
  `Gate(<folder>/gate)`, `freeze_engine=True` included (a request vLLM itself must still hold when
  the test acts: an engine killed under it). Budgets hold the output; the gate can hold the engine.

The runner writes back, in the same folder: `<id>.at-<point>` when it reached a hold,
`<id>.interrupted` (the exception's name) when the injected exception ended a `submit` hold,
`<id>.cancel-seen` when the prediction's cancel signal fired, `<id>.generating` when its
generation reached the engine and `<id>.ended` ("finished" or "aborted") when it left it.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
for _import_root in (_ROOT / "cog", _ROOT):  # what cog/predict.py does for itself, before importing it
    if str(_import_root) not in sys.path:
        sys.path.insert(0, str(_import_root))

import cog_bridge  # noqa: E402
import cog_cancel  # noqa: E402
import coglet_internals  # noqa: E402
import predict  # noqa: E402  (installs the runner's cancel hook)

from shared.engine.vllm_startup import open_engine  # noqa: E402
from shared.engine.wrapper import EngineWrapper  # noqa: E402
from shared.settings import Settings  # noqa: E402
from tests.gate import GatedEngine  # noqa: E402

HOLD_DIR_VARIABLE = "COG_TEST_HOLD_DIR"
GATE_FOLDER = "gate"  # inside the hold folder: the gate's rules (tests/gate.py)
HOLD_LIMIT_S = 120.0  # a hold whose cancel never comes fails its prediction rather than hang
POLL_S = 0.01

_prediction: contextvars.ContextVar[str | None] = contextvars.ContextVar("test_prediction_id", default=None)


def _folder() -> Path:
    return Path(os.environ[HOLD_DIR_VARIABLE])


def _read(prediction: str, name: str) -> str | None:
    try:
        return (_folder() / f"{prediction}.{name}").read_text().strip()
    except FileNotFoundError:
        return None


def _mark(prediction: str, name: str, text: str = "") -> None:
    path = _folder() / f"{prediction}.{name}"
    scratch = path.with_name(path.name + ".tmp")
    scratch.write_text(f"{text}\n{time.time():.6f}\n")
    scratch.replace(path)  # whole or absent: the test polls these


# --- the slot thread: coglet submitting run() -------------------------------------------------------
_runner_submit = asyncio.run_coroutine_threadsafe  # the runner's hook, installed by `import predict`


def _submit(coro: Coroutine[Any, Any, Any], loop: asyncio.AbstractEventLoop) -> Any:
    prediction = _prediction_of(coro)
    if prediction is None:
        return _runner_submit(coro, loop)
    context = contextvars.copy_context()
    context.run(_prediction.set, prediction)  # run() and its generation see it (copied from here)
    run = context.run(_runner_submit, coro, loop)
    signal = getattr(run, "signal", None)
    if signal is not None:
        signal.add(lambda: _mark(prediction, "cancel-seen"))
    if _read(prediction, "hold") == "submit":
        _wait_for_injection(prediction)
    return run


def _prediction_of(coro: Coroutine[Any, Any, Any]) -> str | None:
    return coglet_internals.prediction_id(coro) if coglet_internals.is_run(coro) else None


def _wait_for_injection(prediction: str) -> None:
    """Python bytecode in a loop: coglet raises the injected CancelationException in here."""
    _mark(prediction, "at-submit")
    deadline = time.monotonic() + HOLD_LIMIT_S
    try:
        while time.monotonic() < deadline:
            time.sleep(POLL_S)
    except BaseException as exc:
        _mark(prediction, "interrupted", type(exc).__name__)
        raise
    raise RuntimeError(f"hold at submit: no cancel came within {HOLD_LIMIT_S} s")


asyncio.run_coroutine_threadsafe = _submit  # type: ignore[assignment]


# --- the loop: run()'s awaits -----------------------------------------------------------------------
def _held_open(open_: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def open_then_hold(*args: Any, **kwargs: Any) -> Any:
        subscription = await open_(*args, **kwargs)
        prediction = _prediction.get()
        if prediction is not None and _read(prediction, "hold") == "open":
            _mark(prediction, "at-open")
            await _until_cancelled(prediction, ignore_task_cancel=False)
            _mark(prediction, "left-open")
        return subscription

    return open_then_hold


def _held_start(start: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def start_then_hold(*args: Any, **kwargs: Any) -> Any:
        subscription = await start(*args, **kwargs)
        prediction = _prediction.get()
        if prediction is not None and _read(prediction, "hold") == "return":
            _mark(prediction, "at-return")
            await _until_cancelled(prediction, ignore_task_cancel=True)
            _mark(prediction, "left-return")
        return subscription

    return start_then_hold


async def _until_cancelled(prediction: str, *, ignore_task_cancel: bool) -> None:
    signal = cog_cancel.current_cancel_signal(under_coglet=True)
    assert signal is not None, "the runner's cancel hook did not give this run() a signal"
    deadline = time.monotonic() + HOLD_LIMIT_S
    while not signal.fired and time.monotonic() < deadline:
        try:
            await asyncio.sleep(POLL_S)
        except asyncio.CancelledError:
            if not ignore_task_cancel:
                raise


cog_bridge.start_generation = _held_start(cog_bridge.start_generation)  # type: ignore[assignment]


# --- the engine: the gate and the budgets, both inside the service's guard --------------------
@asynccontextmanager
async def _gated_engine(settings: Settings) -> AsyncIterator[Any]:
    """The real engine behind the test gate, as tests/gated_serve.py gives the HTTP server one (the
    gate reaches vLLM itself, `llm`, to freeze it), its outputs held within each prediction's
    budget (`HeldEngine`); the service's GuardedEngine wraps the two, and every part of the
    service that generates (new generations, takeovers) holds this one engine."""
    folder = _folder() / GATE_FOLDER
    folder.mkdir(exist_ok=True)
    async with open_engine(settings) as engine:
        yield HeldEngine(GatedEngine(engine, folder))


predict.start_service = functools.partial(predict.start_service, engine_factory=_gated_engine)  # type: ignore[assignment]


class HeldEngine(EngineWrapper):
    """The service's engine, its outputs passed on within each prediction's budget."""

    async def generate(self, request_id: str, request: Any) -> AsyncIterator[Any]:
        prediction = _prediction.get()
        if prediction is None:  # the warm-up, or anything not from a prediction
            async for delta in self.inner.generate(request_id, request):
                yield delta
            return
        _mark(prediction, "generating")
        how = "aborted"
        try:
            passed = 0
            async for delta in self.inner.generate(request_id, request):
                if delta.text:
                    await _within_budget(prediction, passed + 1)
                    passed += 1
                yield delta
            how = "finished"
        finally:
            _mark(prediction, "ended", how)


async def _within_budget(prediction: str, wanted: int) -> None:
    while (budget := _read(prediction, "budget")) is not None and int(budget) < wanted:
        await asyncio.sleep(POLL_S)


class Runner(predict.Runner):
    async def setup(self, weights: Path | str | None = None) -> None:
        if not os.environ.get(HOLD_DIR_VARIABLE):
            raise RuntimeError(f"{HOLD_DIR_VARIABLE} must name the folder of the test's hold files")
        await super().setup(weights)  # the engine gated and held by `_gated_engine`
        self.service.open = _held_open(self.service.open)  # type: ignore[method-assign]
