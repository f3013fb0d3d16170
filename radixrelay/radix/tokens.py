"""Token ids as int32 arrays: what the radix tree keys on and what a request's tokens are.

``as_tokens`` gives a 1-D int32 array for any token sequence (a ``TokenArray``'s view or an int32 array as
they are, anything else converted once); ids outside int32 are a ``ValueError``. Comparing two such
arrays is one C-speed pass (``np.array_equal``, or ``first_difference`` for where they part), which is
how the radix tree matches prompts: no Python object per token is made or compared.

``TokenArray`` is one request's tokens, prompt then outputs, in int32: the prompt as it arrived (the
unpacked message, not copied) and the outputs in a growable buffer, joined into one buffer the first time
the whole is asked for with outputs in it. Invariant: tokens only grow, so ``array`` (a read-only view of
``[0, len)``) taken at any time keeps its values for good, and a view taken before an ``append`` that
reallocates still reads the old buffer, which holds the same values. Indexing gives Python ints, slicing
gives lists (what messages and stop checks take: short ranges); whole-prompt work goes through ``array``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

TOKEN_DTYPE = np.dtype(np.int32)
_INT32 = np.iinfo(np.int32)


def as_tokens(ids: TokenArray | np.ndarray | Sequence[int], length: int | None = None) -> np.ndarray:
    """``ids`` as a 1-D int32 array: a ``TokenArray``'s view, an int32 array itself, anything else a
    converted copy. ``length``: only ``ids[:length]`` is needed (a ``TokenArray`` may then give its
    prompt without joining its outputs to it; other forms may give more). ``ValueError`` for ids outside
    int32 (no token of any vocabulary)."""
    if isinstance(ids, TokenArray):
        return ids.array if length is None else ids.prefix(length)
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
    if n <= 16384 and a[:n].tobytes() == b[:n].tobytes():     # short: a copy and memcmp beat the ufuncs
        return n
    ne = a[:n] != b[:n]
    i = int(ne.argmax()) if n else 0
    return i if n and ne[i] else n


class TokenArray:
    """A request's token ids (see the module docstring).

    Two parts while they can stay apart: ``_head``, the ids it was made from (a read-only int32 array is
    kept as it is, no copy: its owner must not change it; anything else is converted once), and ``_tail``,
    a growable buffer of the ids appended since. ``array`` joins them into ``_tail`` the first time it is
    asked for with any appended (one copy in the request's life; a prompt's admission, its first token and
    a release of prompt pages never ask), after which ``_head`` is empty and ``_tail`` holds everything."""

    __slots__ = ("_head", "_tail", "_len")

    def __init__(self, ids: TokenArray | np.ndarray | Sequence[int] = ()) -> None:
        if isinstance(ids, TokenArray):
            ids = ids.array
        arr = as_tokens(ids)
        if arr.flags.writeable:
            arr = arr.copy() if arr is ids else arr      # a caller's writable array: copied; ours: kept
            arr.flags.writeable = False
        self._head = arr
        self._tail = np.empty(16, dtype=TOKEN_DTYPE)
        self._len = len(arr)

    @property
    def array(self) -> np.ndarray:
        """``[0, len)`` as a read-only int32 array (its values never change)."""
        head = self._head
        if self._len == len(head):
            return head
        if len(head):                                    # join once: the tail takes everything
            joined = np.empty(max(2 * self._len, 64), dtype=TOKEN_DTYPE)
            joined[:len(head)] = head
            joined[len(head):self._len] = self._tail[:self._len - len(head)]
            self._tail, self._head = joined, _EMPTY
        view = self._tail[:self._len]
        view.flags.writeable = False
        return view

    def prefix(self, n: int) -> np.ndarray:
        """``array[:n]``, without joining the outputs when they lie past ``n``."""
        return self._head[:n] if n <= len(self._head) else self.array[:n]

    def append(self, token: int) -> None:
        i = self._len - len(self._head)                  # the slot in _tail
        if i == len(self._tail):
            grown = np.empty(2 * len(self._tail), dtype=TOKEN_DTYPE)
            grown[:i] = self._tail[:i]
            self._tail = grown
        self._tail[i] = token
        self._len += 1

    def tolist(self) -> list[int]:
        return self[:]

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int | slice) -> int | list[int]:
        head = self._head
        if isinstance(index, slice):
            start, stop, step = index.indices(self._len)
            if step != 1:
                return self.array[index].tolist()
            out = head[start:stop].tolist() if start < len(head) else []
            if stop > len(head):
                out += self._tail[max(start - len(head), 0):stop - len(head)].tolist()
            return out
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError("token index out of range")
        return int(head[index]) if index < len(head) else int(self._tail[index - len(head)])

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


_EMPTY = np.empty(0, dtype=TOKEN_DTYPE)
_EMPTY.flags.writeable = False
