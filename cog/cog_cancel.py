"""Coglet's cancel -> this prediction's engine request, whenever the cancel comes: a hook on
coglet's submission of run() that hands it a future whose cancel aborts what run() opened.

How coglet 0.23.1 delivers `POST /predictions/{id}/cancel` to an async `run()` (its worker's
source, crates/coglet-python/src/worker_bridge.rs, checked against its trace log): the
orchestrator sends the worker `Cancel{slot}`, and the worker acts on what it knows of that slot:

1. Idle: the prediction's request has not reached the worker's `predict()` yet. Nothing is done
   and nothing is kept: the cancel is lost. No Python runs on this path, so no runner can see
   it; measured with a cancel right behind a `Prefer: respond-async` PUT, a few per cent of
   cancels (docs/cog.md, "Cancel"). Only coglet can fix it.
2. Started, but coglet does not hold run()'s future yet (it is preparing the inputs, calling
   run(), submitting it): `CancelationException` is injected into the slot thread
   (`PyThreadState_SetAsyncExc`) and raised in whatever Python that thread runs next; the
   "cancelled" flag coglet sets is overwritten once it stores the future. Raised after the
   submission, by itself it leaves run() running with nobody to read or stop what it started.
   Coglet may also lose it: logged as injected, it is never raised when it lands while the slot
   thread is in coglet's own code between two calls into Python (measured; docs/cog.md).
3. Holding the future that `asyncio.run_coroutine_threadsafe` returned: `future.cancel()`. If
   run() is at an await, its task is cancelled there; if run() has returned its generator (or
   returns it before the loop turns to the cancel), the future is done, the cancel does nothing
   and by itself the generator runs to its end, read or not (coglet never tells a generator).

So `install_coglet_cancel_hook` wraps `asyncio.run_coroutine_threadsafe` (coglet looks it up on
the module at call time) and hands coglet a `CogletRun` for each run():
- run() is submitted only when coglet's slot thread first waits for it, inside a block that
  catches the injected exception of case 2: a cancel before that point starts nothing; one after
  it cancels the run like case 3, and coglet reports "canceled" (not "failed").
- Its `cancel` fires the run's `CancelSignal` first, then cancels the task. The runner registers
  on that signal whatever it opened (`cog_bridge.start_generation`) and the wait its generator is
  in (`cog_bridge.stream_text`), so the engine request is aborted however far run() got: mid-await,
  returning, or returned.

FRAGILE by nature: it depends on coglet internals (the function it calls, the name of its
wrapper coroutine, that it only calls `result()` and `cancel()` on what it gets, measured on
0.23.1), read through cog/coglet_internals.py and checked there at start. A broken assumption is
logged as a warning (there, and at the first run() in `current_cancel_signal`); the effect is
then that a cancelled prediction's engine request runs to its end. Remove this when coglet
propagates cancellation to generators and keeps a cancel that arrives early.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import logging
import threading
import weakref
from collections.abc import Callable, Coroutine
from typing import Any

import coglet_internals

log = logging.getLogger(__name__)


class CancelSignal:
    """Fired once, from coglet's thread or a slot thread; callbacks added after firing run at once.

    Callbacks are taken one at a time, so a fire interrupted half-way (an exception injected into
    the firing thread) is finished by the next call instead of being lost."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []
        self.fired = False

    def add(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if not self.fired:
                self._callbacks.append(callback)
                return
        callback()

    def fire(self) -> None:
        with self._lock:
            self.fired = True
        while True:
            with self._lock:
                if not self._callbacks:
                    return
                callback = self._callbacks.pop(0)
            try:
                callback()
            except Exception:  # a failing callback must not break coglet's cancel path
                log.exception("cancel callback failed")


_current_signal: contextvars.ContextVar[CancelSignal | None] = contextvars.ContextVar(
    "bundle_cog_cancel_signal", default=None
)
_hook_state = {"installed": False, "warned": False}
plain_submit = asyncio.run_coroutine_threadsafe


def install_coglet_cancel_hook() -> bool:
    """Wrap asyncio.run_coroutine_threadsafe once; False (and a warning) if it can't be done."""
    if _hook_state["installed"]:
        return True
    if asyncio.run_coroutine_threadsafe is not plain_submit:
        log.warning(
            "asyncio.run_coroutine_threadsafe is already replaced by someone else; Cog cancel "
            "will not abort engine requests early"
        )
        return False
    asyncio.run_coroutine_threadsafe = submit_with_cancel_signal  # type: ignore[assignment]
    _hook_state["installed"] = True
    return True


def submit_with_cancel_signal(
    coro: Coroutine[Any, Any, Any], loop: asyncio.AbstractEventLoop
) -> concurrent.futures.Future[Any]:
    if not coglet_internals.is_run(coro):
        return plain_submit(coro, loop)  # not coglet submitting a run(): untouched
    signal = CancelSignal()
    context = contextvars.copy_context()
    context.run(_current_signal.set, signal)
    return CogletRun(coro, loop, signal, context)


def current_cancel_signal(*, under_coglet: bool) -> CancelSignal | None:
    """This run()'s signal; None (with one warning) when coglet did not go through the hook."""
    signal = _current_signal.get()
    if signal is None and under_coglet and not _hook_state["warned"]:
        _hook_state["warned"] = True
        log.warning(
            "coglet did not submit run() through asyncio.run_coroutine_threadsafe(%s(...)) as "
            "coglet 0.23.1 does (hook installed: %s); POST /predictions/{id}/cancel will not "
            "abort the engine request, which then runs to its end",
            coglet_internals.RUN_WRAPPER,
            _hook_state["installed"],
        )
    return signal


class CogletRun(concurrent.futures.Future[Any]):
    """The future coglet gets for one run(): submitted to the loop when coglet first waits on it,
    its outcome copied from the submitted one, its cancel firing the run's signal first."""

    def __init__(
        self,
        coro: Coroutine[Any, Any, Any],
        loop: asyncio.AbstractEventLoop,
        signal: CancelSignal,
        context: contextvars.Context,
    ) -> None:
        super().__init__()
        self.signal = signal
        self._loop = loop
        self._context = context  # carries the signal: call_soon_threadsafe and the task copy it
        self._unstarted = [coro]
        self._submitted: concurrent.futures.Future[Any] | None = None
        self._lock = threading.Lock()
        # Never waited on (coglet failed the prediction before that): close the coroutines, so
        # nothing warns that they were never awaited. Nothing ran, nothing is left running.
        finalizer = weakref.finalize(self, _close_unstarted, self._unstarted)
        finalizer.atexit = False

    def result(self, timeout: float | None = None) -> Any:
        # Everything after the first line runs inside the try, where an exception injected into
        # this slot thread (case 2 of the module's docstring) is caught.
        try:
            self._submit()
            return super().result(timeout)
        except concurrent.futures.TimeoutError:
            raise  # a caller that polls (coglet 0.23.1 does not) just waits again
        except BaseException as exc:
            if self._failed_with(exc):
                raise  # run() itself failed (bad input...): coglet reports that
            self.cancel()
            # Coglet 0.23.1 reports an error naming CancelledError as "canceled", not "failed".
            raise concurrent.futures.CancelledError(f"prediction cancelled ({type(exc).__name__})") from exc

    def cancel(self) -> bool:
        self.signal.fire()  # first: what run() opened is left even if run() returns right now
        with self._lock:
            submitted = self._submitted
            cancelled = super().cancel()
        if submitted is not None:
            submitted.cancel()  # run_coroutine_threadsafe's future cancels the task in turn
        return cancelled

    def _submit(self) -> None:
        with self._lock:
            if self._submitted is not None or self.done():  # done: cancelled before the wait
                return
            coro = self._unstarted.pop()
            self._submitted = self._context.run(plain_submit, coro, self._loop)
        self._submitted.add_done_callback(self._copy_outcome)

    def _copy_outcome(self, submitted: concurrent.futures.Future[Any]) -> None:
        if submitted.cancelled():
            concurrent.futures.Future.cancel(self)  # not ours: the signal is coglet's to fire
            return
        # InvalidStateError: coglet cancelled this future meanwhile; what run() opened is left
        # through the signal, which fired first.
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            error = submitted.exception()
            if error is not None:
                self.set_exception(error)
            else:
                self.set_result(submitted.result())

    def _failed_with(self, exc: BaseException) -> bool:
        return self.done() and not self.cancelled() and self.exception(0) is exc


def _close_unstarted(unstarted: list[Coroutine[Any, Any, Any]]) -> None:
    for wrapper in unstarted:
        inner = coglet_internals.wrapped_run(wrapper)  # read before the wrapper's frame goes
        for coro in (wrapper, inner):
            if coro is not None:
                with contextlib.suppress(Exception):
                    coro.close()
