"""Token ids as int32 arrays: what the radix tree keys on and what a request's tokens are.

``as_tokens`` gives a 1-D int32 array for any token sequence (a ``TokenArray``'s view or an int32 array as
they are, anything else converted once); ids outside int32 are a ``ValueError``. Comparing two such
arrays is one C-speed pass (``np.array_equal``, or ``first_difference`` for where they part), which is
how the radix tree matches prompts: no Python object per token is made or compared.

``TokenArray`` is one request's tokens, prompt then outputs: a growable int32 buffer. Invariant: tokens
only grow, so ``array`` (a read-only view of ``[0, len)``) taken at any time keeps its values for good,
and a view taken before an ``append`` that reallocates still reads the old buffer, which holds the same
values. Indexing gives Python ints, slicing gives lists (what messages and stop checks take: short
ranges); whole-prompt work goes through ``array``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

TOKEN_DTYPE = np.dtype(np.int32)
_INT32 = np.iinfo(np.int32)


def as_tokens(ids: TokenArray | np.ndarray | Sequence[int]) -> np.ndarray:
    """``ids`` as a 1-D int32 array: a ``TokenArray``'s view, an int32 array itself, anything else a
    converted copy. ``ValueError`` for ids outside int32 (no token of any vocabulary)."""
    if isinstance(ids, TokenArray):
        return ids.array
    if isinstance(ids, np.ndarray) and ids.dtype == TOKEN_DTYPE and ids.ndim == 1:
        return ids
    try:
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
    except OverflowError:
        raise ValueError("token ids must fit int32") from None
    if arr.size and (arr.min() < _INT32.min or arr.max() > _INT32.max):
        raise ValueError("token ids must fit int32")
    return arr.astype(TOKEN_DTYPE)


def first_difference(a: np.ndarray, b: np.ndarray) -> int:
    """Index of the first position where ``a`` and ``b`` differ, ``min(len)`` when one is a prefix of
    the other. One C pass over the shorter."""
    n = min(len(a), len(b))
    ne = a[:n] != b[:n]
    i = int(ne.argmax()) if n else 0
    return i if n and ne[i] else n


class TokenArray:
    """A request's token ids (see the module docstring)."""

    __slots__ = ("_buf", "_len")

    def __init__(self, ids: TokenArray | np.ndarray | Sequence[int] = ()) -> None:
        arr = as_tokens(ids)
        n = len(arr)
        self._buf = np.empty(n + max(64, n >> 6), dtype=TOKEN_DTYPE)   # room for some outputs
        self._buf[:n] = arr
        self._len = n

    @property
    def array(self) -> np.ndarray:
        """``[0, len)`` as a read-only int32 view (its values never change)."""
        view = self._buf[:self._len]
        view.flags.writeable = False
        return view

    def append(self, token: int) -> None:
        if self._len == len(self._buf):
            grown = np.empty(2 * len(self._buf), dtype=TOKEN_DTYPE)
            grown[:self._len] = self._buf[:self._len]
            self._buf = grown
        self._buf[self._len] = token
        self._len += 1

    def tolist(self) -> list[int]:
        return self._buf[:self._len].tolist()

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            return self._buf[:self._len][index].tolist()
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError("token index out of range")
        return int(self._buf[index])

    def __iter__(self) -> Iterator[int]:
        return iter(self.tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (TokenArray, np.ndarray, list, tuple)):
            other_arr = other.array if isinstance(other, TokenArray) else np.asarray(other)
            return bool(len(other_arr) == self._len and np.array_equal(self.array, other_arr))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]   # mutable (grows)

    def __repr__(self) -> str:
        return f"TokenArray({self._len} tokens)"
