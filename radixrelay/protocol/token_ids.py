"""Prompt token ids on the frontend -> scheduler channel, packed, and as the scheduler keeps them.

A long prompt as a msgpack array costs a Python int object per token on both sides (the Engine's
``tolist``, the scheduler's decode), O(prompt) allocations on every arrival. Packed,
``GenerateRequest.token_ids`` is int32 little-endian bytes (4 bytes a token; msgpack ``bin``), made
from the array the frontend already validated with numpy.

The scheduler keeps them as an int32 array end to end (``unpack_token_ids``: one ``frombuffer`` and
one copy into the request's ``TokenArray``, ``radixrelay.radix.tokens``): no Python object per token
on arrival. The radix tree matches that array against its nodes' int32 keys at C speed, the content
keys of the lower KV tiers are hashed from it, and the worker's admission carries only the uncached
ids (``Scheduler._admission``: a list of the tokens past the cached prefix). There is no token table
(ids as references to one shared int object per vocabulary entry, so that list compares hit identity):
gathering those scattered objects cost a cache miss per token, the largest part of an arrival.

A plain ``list[int]`` stays valid on the wire (tests, callers with a list at hand); ids outside int32
are refused by the scheduler (``ValueError``: the request is rejected as invalid).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from radixrelay.radix.tokens import as_tokens

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


def unpack_token_ids(wire: list[int] | bytes) -> np.ndarray:
    """The ids of a ``GenerateRequest`` as an int32 array (a read-only view of packed bytes, converted
    from a list). ``ValueError``: bytes that are not whole int32s, ids outside int32."""
    if isinstance(wire, list):
        return as_tokens(wire)
    if len(wire) % _WIRE.itemsize:
        raise ValueError(f"packed token ids: {len(wire)} bytes is not a whole number of int32 ids")
    return np.frombuffer(wire, dtype=_WIRE).astype(np.int32, copy=False)
