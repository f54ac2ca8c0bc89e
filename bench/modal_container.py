"""A Modal container's life, run here: Modal 1.6.4's own container code drives a `modal.Cls`.

What a container does with a class (`modal/_container_entrypoint.py` -> `run_function`, and
`modal/_runtime/user_code_imports.py`), and what this module calls, unchanged:

    UserCodeEventLoop()                       one event loop for all user code
    ImportedClass.function_execution_context  in this order, each on that loop:
      enter hooks flagged ENTER_PRE_SNAPSHOT  (`@modal.enter(snap=True)`)
      the memory snapshot                     (only when the function snapshots)
      enter hooks flagged ENTER_POST_SNAPSHOT (`@modal.enter(snap=False)`, after each restore)
      get_finalized_functions                 calls the `@modal.asgi_app()` method
      LifespanManager.lifespan_startup        the ASGI app's lifespan
      ... the inputs (requests) ...
      lifespan shutdown, EXIT hooks, volume commit

Only the two objects that talk to Modal's servers are replaced, by `ContainerRecorder`: the task
lifecycle manager (which reports a failed hook to Modal, takes the snapshot and commits volumes)
and the container I/O manager's snapshot helpers. Each call Modal makes to it marks a phase, so
the phases are timed from inside Modal's own sequence. Requests reach the app through Modal's
input plane in a container; here the caller serves the app on the same loop (uvicorn).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from modal._runtime.container_io_manager import ContainerIOManager

# Modal's calls into its task lifecycle manager's `handle_task_lifecycle_exception`, in the order
# `function_execution_context` makes them (1.6.4): the snapshot falls between the first two.
PHASES = (
    "enter_pre_snapshot",
    "enter_post_snapshot",
    "asgi_app",
    "lifespan_startup",
    "lifespan_shutdown",
    "exit",
)


@dataclass
class Phase:
    name: str
    started: float
    ended: float | None = None

    @property
    def seconds(self) -> float:
        return (self.ended or self.started) - self.started


@dataclass
class ContainerRecorder:
    """Stands in for Modal's `TaskLifecycleManager` and `ContainerIOManager` where they would
    call Modal's servers. `on_snapshot` runs at the snapshot point (measure what is in memory)."""

    on_snapshot: Callable[[], None] = lambda: None
    phases: list[Phase] = field(default_factory=list)
    events: dict[str, float] = field(default_factory=dict)
    leftover_tasks: list[str] = field(default_factory=list)  # on the loop after the exit hooks

    # --- TaskLifecycleManager ------------------------------------------------------------------
    @contextlib.contextmanager
    def handle_task_lifecycle_exception(self) -> Iterator[None]:
        # Modal reports the failure to its servers and ends the container; here it propagates
        # to the caller, with its own traceback.
        index = len(self.phases)
        phase = Phase(PHASES[index] if index < len(PHASES) else f"unexpected_{index}", time.perf_counter())
        self.phases.append(phase)
        try:
            yield
        finally:
            phase.ended = time.perf_counter()

    def memory_snapshot(self) -> None:
        self.events["snapshot"] = time.perf_counter()
        self.on_snapshot()
        self.events["snapshot_done"] = time.perf_counter()

    def volume_commit(self, volume_ids: list[str]) -> None:
        self.events["volume_commit"] = time.perf_counter()

    # --- ContainerIOManager --------------------------------------------------------------------
    def get_task_lifecycle_manager(self) -> ContainerRecorder:
        return self

    def snapshot_context_manager(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def _install_breakpoint_hook(self) -> None:
        # Modal calls this right after the snapshot point: a restored container starts here.
        self.events["restored"] = time.perf_counter()

    def phase(self, name: str) -> Phase:
        return next(p for p in self.phases if p.name == name)

    def order_problems(self, snapshots: bool) -> list[str]:
        """What differs from Modal's documented order (empty when it is Modal's)."""
        problems = []
        if [p.name for p in self.phases] != list(PHASES):
            problems.append(f"phases {[p.name for p in self.phases]} are not {list(PHASES)}")
        elif snapshots:
            pre, post = self.phase("enter_pre_snapshot"), self.phase("enter_post_snapshot")
            snapshot = self.events.get("snapshot")
            if snapshot is None or not (pre.ended or 0) <= snapshot <= post.started:
                problems.append("the snapshot point is not between the snap=True and snap=False hooks")
        elif "snapshot" in self.events:
            problems.append("a snapshot was taken with snapshots off")
        return problems


@dataclass
class Container:
    loop: Any  # modal._runtime.user_code_event_loop.UserCodeEventLoop
    instance: Any  # the user class instance Modal made (its `self` in every hook)
    asgi_app: Any  # what the `@modal.asgi_app()` method returned


@contextlib.contextmanager
def run_container(modal_cls: Any, recorder: ContainerRecorder, *, snapshots: bool) -> Iterator[Container]:
    """Run `modal_cls` (a `modal.Cls`, e.g. `modal_app.app.Server`) as a container would, up to
    its inputs; serve them inside the `with` (on `container.loop`); leaving it runs the shutdown."""
    from modal._runtime.task_lifecycle_manager import _TaskLifecycleManager
    from modal._runtime.user_code_event_loop import UserCodeEventLoop
    from modal._runtime.user_code_imports import ImportedClass, get_user_class_instance
    from modal._utils.async_utils import synchronizer
    from modal_proto import api_pb2

    _cls = synchronizer._translate_in(modal_cls)
    definition = api_pb2.Function(
        is_checkpointing_function=snapshots, _experimental_enable_gpu_snapshot=snapshots
    )
    # Modal's worker sets this for the task it snapshots; `maybe_snapshot` reads it.
    saved = os.environ.get("MODAL_ENABLE_SNAP_RESTORE")
    os.environ["MODAL_ENABLE_SNAP_RESTORE"] = "1" if snapshots else "0"
    # A task lifecycle manager existing is what makes `modal.is_local()` false in a container.
    # Built for that alone, with no client (offline): nothing here lets it call Modal's servers.
    _TaskLifecycleManager("ta-rehearsal", "fu-rehearsal", definition, None, None)  # type: ignore[arg-type]
    try:
        partials = _cls._get_partial_functions()
        service = ImportedClass(
            user_cls_instance=get_user_class_instance(_cls, (), {}),
            app=None,  # type: ignore[arg-type]  # no deployed App: the hooks and the ASGI app never ask
            service_deps=None,
            _partial_functions=partials,
            function_def=definition,
        )
        with UserCodeEventLoop() as loop:
            # The recorder stands in for the ContainerIOManager (its class docstring says which parts).
            io_manager = cast("ContainerIOManager", recorder)
            with service.function_execution_context(loop, io_manager) as finalized:
                apps = [f.lifespan_manager.asgi_app for f in finalized.values() if f.lifespan_manager]
                if len(apps) != 1:
                    raise RuntimeError(f"expected one @modal.asgi_app method, found {len(apps)}")
                yield Container(loop, service.user_cls_instance, apps[0])
            loop.run(_settle())
            recorder.leftover_tasks = pending_tasks(loop.loop)
    finally:
        _TaskLifecycleManager._reset_singleton()
        if saved is None:
            os.environ.pop("MODAL_ENABLE_SNAP_RESTORE", None)
        else:
            os.environ["MODAL_ENABLE_SNAP_RESTORE"] = saved


async def _settle() -> None:
    """A few loop turns: tasks Modal cancelled at shutdown finish cancelling."""
    for _ in range(5):
        await asyncio.sleep(0.01)


def pending_tasks(loop: asyncio.AbstractEventLoop) -> list[str]:
    """Tasks on the container's loop, not running now, that have not finished."""
    return sorted(getattr(task.get_coro(), "__qualname__", repr(task)) for task in asyncio.all_tasks(loop))
