"""What a shutdown is still waiting for, said once when it takes too long: each pending task's stack.

A shutdown that hangs ends in a kill from outside (a supervisor, the platform) with nothing in the
log about why; this names the awaits it was stuck in while the process can still say so.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

log = logging.getLogger(__name__)

FRAMES_PER_TASK = 6  # the innermost awaits say where it waits


@contextlib.contextmanager
def report_if_slow(what: str, after_s: float) -> Iterator[None]:
    """Log every pending task's stack if the block is still running `after_s` seconds in."""
    handle = asyncio.get_running_loop().call_later(after_s, _report, what, after_s)
    try:
        yield
    finally:
        handle.cancel()


def _report(what: str, after_s: float) -> None:
    stacks = []
    for task in asyncio.all_tasks():
        frames = task.get_stack(limit=FRAMES_PER_TASK)
        where = " <- ".join(
            f"{f.f_code.co_name} ({f.f_code.co_filename}:{f.f_lineno})" for f in reversed(frames)
        )
        stacks.append(f"  {task.get_name()}: {where or 'not started'}")
    log.warning("%s still running after %g s; pending tasks:\n%s", what, after_s, "\n".join(stacks))
