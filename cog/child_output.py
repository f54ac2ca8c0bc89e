"""Plain stdout/stderr for the processes vLLM forks inside coglet's worker.

Why (measured with coglet 0.23.1 and vLLM 0.26's GPU build, where setup failed with no cause logged):
- Coglet's worker replaces `sys.stdout`/`sys.stderr` with `coglet._sdk._SlotLogWriter`, a Rust
  object that hands every line to a tokio channel read by the worker's own runtime threads.
  Its file descriptors 1 and 2 are pipes that other worker threads read into coglet's log.
- vLLM 0.26 (the GPU build) starts its engine core by `fork` and, first thing in the child, calls
  `decorate_logs()`, which sets attributes on both streams (`start_new_line`, `write`). The
  Rust object has no `__dict__`: AttributeError, the core exits with 1. Its traceback, and
  anything else the child writes through the copied writer, goes to a channel whose reading
  threads were not copied by fork: lost. So the parent only says "Engine core initialization
  failed. See root cause above" with nothing above. (`VLLM_CONFIGURE_LOGGING=0` skips
  `decorate_logs`, so the core starts; `spawn` starts a fresh interpreter with plain streams,
  at the price of importing vLLM again. vLLM's CPU platform forces spawn, and 0.32 does not
  wrap the streams, so the runner on CPU never meets this.)

The fix keeps fork (the cheap start): every child forked from the worker starts with plain,
line-buffered text streams on descriptors 1 and 2, the pipes coglet already reads, and the
logging handlers that held the worker's writer follow. vLLM's decoration then works, and
whatever a child prints reaches coglet's log. The worker itself keeps coglet's writer, which
routes its lines to the right prediction.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

_state = {"installed": False}


def give_forked_children_plain_streams(*, under_coglet: bool) -> bool:
    """Register (once, and only inside coglet's worker) the fork hook described above.

    True when it was registered by this call. Outside coglet the process's streams are
    ordinary files that fork copies fine, so nothing is changed there."""
    if not under_coglet or _state["installed"]:
        return False
    os.register_at_fork(after_in_child=_plain_streams_in_child)
    _state["installed"] = True
    return True


def _plain_streams_in_child() -> None:
    """Runs in the child right after fork, before any of its own code."""
    old_out, old_err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _fd_stream(1), _fd_stream(2)
    for handler in _stream_handlers():
        # Not setStream(): it flushes the old writer, whose reader is not in this process.
        if handler.stream is old_out:
            handler.stream = sys.stdout
        elif handler.stream is old_err:
            handler.stream = sys.stderr
    sys.stderr.write(
        f"pid {os.getpid()} forked from coglet's worker (pid {os.getppid()}): "
        "its stdout/stderr go to coglet's log\n"
    )


def _fd_stream(fd: int) -> TextIO:
    # A new object on the descriptor, not the interpreter's original one (sys.__stdout__),
    # whose buffer may hold the parent's unflushed text, which the child would repeat.
    # Line-buffered: a child that dies leaves nothing behind in a buffer.
    return open(fd, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115


def _stream_handlers() -> list[logging.StreamHandler[TextIO]]:
    loggers: list[logging.Logger] = [logging.getLogger()]
    for logger in list(logging.Logger.manager.loggerDict.values()):
        if isinstance(logger, logging.Logger):
            loggers.append(logger)
    return [
        handler
        for logger in loggers
        for handler in logger.handlers
        if isinstance(handler, logging.StreamHandler)
    ]
