"""Children that end with the supervisor: if it is killed outright (SIGKILL, an OOM kill), no
API process or local store may linger on, holding the port or the engine's endpoints."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent_pid: int | None = None) -> None:
    """SIGTERM this process when its parent ends (Linux; elsewhere nothing is done). With
    `parent_pid`, also when that parent has ended already (this process was orphaned before it
    got here): the signal is then sent at once."""
    if sys.platform != "linux":
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGTERM)


def end_now(status: int) -> None:
    """End this process at once with `status`; negative: by that signal, as `subprocess` reports
    it. Only once everything it started is gone: it skips the interpreter's teardown (torch's and
    vLLM's modules, a frozen heap), which costs seconds of CPU (over 12 s for an API process on
    the loaded 2-core test box) and can only delay or hang an exit that has nothing left to do."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    if status < 0:
        with contextlib.suppress(OSError, ValueError):  # SIGKILL and SIGSTOP take no handler
            signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    os._exit(128 - status if status < 0 else status)
