"""Prompt token ids on the frontend -> scheduler channel, packed.

A long prompt as a msgpack array costs a Python int object per token on both sides (the Engine's
``tolist``, the scheduler's decode), O(prompt) allocations on every arrival. Packed,
``GenerateRequest.token_ids`` is int32 little-endian bytes (4 bytes a token; msgpack ``bin``), made
from the array the Engine already validated with numpy. The scheduler unpacks them through a
``TokenTable``: the ids become references to one shared int object per vocabulary entry, so no int
is allocated per token, and comparing two prompts' lists (the radix tree's prefix match: a cached
key against a new prompt) hits CPython's identity shortcut instead of comparing values.

A plain ``list[int]`` stays valid on the wire (tests, callers with a list at hand, ids outside int32).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_WIRE = np.dtype("<i4")
_INT32 = np.iinfo(np.int32)


def pack_token_ids(ids: Sequence[int] | np.ndarray) -> list[int] | bytes:
    """Wire form of ``ids``: a numpy integer array whose values fit int32 is packed (no Python int per
    token); anything else (a list: converting it would cost more than sending it) goes as it is."""
    if not isinstance(ids, np.ndarray):
        return ids
    if ids.size and (ids.min() < _INT32.min or ids.max() > _INT32.max):
        return ids.tolist()
    return ids.astype(_WIRE, copy=False).tobytes()


class TokenTable:
    """Unpacks wire token ids into lists of shared int objects for ids in ``[0, size)``; a message with
    an id outside (never from a validated frontend) gets plain ints. Equal values either way."""

    def __init__(self, size: int) -> None:
        self._ints = np.arange(size, dtype=np.int64).astype(object)    # [size]: one int object per id

    def unpack(self, wire: list[int] | bytes) -> list[int]:
        if isinstance(wire, list):
            return wire
        if len(wire) % _WIRE.itemsize:
            raise ValueError(f"packed token ids: {len(wire)} bytes is not a whole number of int32 ids")
        ids = np.frombuffer(wire, dtype=_WIRE)
        if ids.size and (ids.min() < 0 or ids.max() >= len(self._ints)):
            return ids.tolist()
        return self._ints[ids].tolist()
