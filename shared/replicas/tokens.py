"""Token ids in the shared log: packed as little-endian uint32, 4 bytes a token."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

_UINT32 = "I"  # 4 bytes on every platform the bundle runs on (checked at import)
assert array(_UINT32).itemsize == 4
_SWAP = sys.byteorder == "big"  # the log is little-endian, whoever wrote it


def pack_ids(ids: Sequence[int]) -> bytes:
    packed = array(_UINT32, ids)
    if _SWAP:
        packed.byteswap()
    return packed.tobytes()


def unpack_ids(raw: bytes) -> list[int]:
    packed = array(_UINT32)
    packed.frombytes(raw)
    if _SWAP:
        packed.byteswap()
    return packed.tolist()
