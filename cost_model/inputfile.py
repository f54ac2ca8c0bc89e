"""Read a user's input file (benchmark, start-up or catalogue JSON) within bounds.

A path on the command line can name anything: a device that never ends (/dev/zero), a FIFO that
never answers, a directory, a multi-gigabyte log. Reading it whole would hang or exhaust memory
before any check ran, so the file is opened without blocking, checked to be a regular file of
bounded size, and read at most one byte past the bound (a file that grows meanwhile is still
refused).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from cost_model.errors import CostModelError

# The largest real input is the H200 benchmark's JSON (about 30 KB) and the packaged catalogue is
# about 26 KB: 4 MiB is over 100x either, and json parses it in well under a second.
MAX_INPUT_BYTES = 4 * 1024 * 1024


def _open(path: Path, what: str) -> int:
    try:
        # O_NONBLOCK: opening a FIFO with no writer would otherwise wait for ever.
        return os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise CostModelError(f"{what} file not found: {path}") from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the name
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise CostModelError(f"cannot read {what} file {path}: {reason}") from None


def _check(mode: int, size: int, path: Path, what: str) -> None:
    if stat.S_ISDIR(mode):
        raise CostModelError(f"cannot read {what} file {path}: it is a directory")
    if not stat.S_ISREG(mode):
        raise CostModelError(f"cannot read {what} file {path}: not a regular file")
    if size > MAX_INPUT_BYTES:
        raise CostModelError(
            f"cannot read {what} file {path}: {size:,} bytes, more than the {MAX_INPUT_BYTES:,} allowed"
        )


def _read_at_most(fd: int, limit: int) -> bytes:
    chunks: list[bytes] = []
    left = limit
    while left > 0:
        chunk = os.read(fd, left)  # one call usually suffices; a short read just loops
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_text(path: Path, what: str) -> str:
    """The file's UTF-8 text; CostModelError (one line) for anything that is not a small text file."""
    fd = _open(path, what)
    try:
        info = os.fstat(fd)  # of the file opened, so nothing can swap it between check and read
        _check(info.st_mode, info.st_size, path, what)
        data = _read_at_most(fd, MAX_INPUT_BYTES + 1)
    except OSError as exc:
        raise CostModelError(f"cannot read {what} file {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    _check(info.st_mode, len(data), path, what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise CostModelError(f"cannot read {what} file {path}: not UTF-8 text") from None
