"""Recent long texts with their ids, for reusing the ids of the longest shared prefix
(``encode_cache.ChunkedEncoder``'s first step for a long text).

An entry holds a text, its ids packed (``array('I')``) and its cut points: positions ``c`` where
``text[c]`` is a space between two ASCII letters (``encode_cache``'s ``"word| word"``), each with
the number of ids that ``text[:c]`` encodes to. By ``encode_cache``'s proof a text ``t`` encodes
as ``encode(t[:c]) + encode(t[c:])`` at every such position of ``t``, so for a new text ``t`` with
``t[:c + 2] == text[:c + 2]`` (the space and the letter after it are the one character of
look-ahead the cut needs), ``c`` is a cut of ``t`` too and ``encode(t)`` is the entry's first
``offset(c)`` ids followed by ``encode(t[c:])``: exact, with nothing re-tokenized to check a seam.
(TensorRT-LLM instead re-tokenizes from a few tokens before the seam and checks that the ids agree
with the cached ones; the cut points make that unnecessary here.) The end of an entry's text is a
cut of ``t`` too when ``t`` extends the text and has ``"word| word"`` there.

Finding the entry: entries are indexed by their first ``key_chars`` characters (every cut is at
least that far in, so any entry that can serve a text shares them; conversations under one system
prompt share a key, up to ``MAX_PER_KEY`` of them). The candidates are tried most recently used
first. For each, one ``startswith`` tells whether ``t`` extends the whole entry; otherwise a binary
search over the cut points compares only the not yet compared segment at each step, so a lookup is
O(log cuts) Python operations and about two passes of C-level comparison and copying over the text.
A candidate after one that matched must beat its cut: the ``WINDOW`` characters before its next cut
are compared first, which turns down one that departed earlier at the cost of a short comparison.
Nothing is held locked while comparing: entries never change once made.

A caller that wants a list rather than the packed ids gets a slice of a list made from the entry's
ids once (``listed``; the encoder makes it of one shared int object per vocabulary entry, so it costs
8 bytes an id and comparisons of such lists take CPython's identity shortcut).

What is kept (``remember``): a text that extends an entry replaces it (it serves every text the
entry served, as well); a text that shares a prefix with an entry is added only when it brings at
least ``min_new_chars`` characters past the entry's reusable cut (so 128 questions over one document
keep one entry, not 128 copies). Bounded by bytes (texts, ids, their lists and cut points), least
recently used first out; one text may take at most a quarter of the bound, and ``MAX_PER_KEY``
entries share a key.
"""

from __future__ import annotations

import re
import sys
import threading
from array import array
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

MAX_PER_KEY = 32       # entries sharing their first key_chars characters (least recently used out)
WINDOW = 256           # characters before a cut compared first, to turn most candidates down cheaply

_CUT_AT = re.compile(r"(?<=[A-Za-z]) (?=[A-Za-z])")    # encode_cache._CUT, matched at one position


class Entry:
    """A remembered text: ``ids`` is its encoding; ``cuts[i]`` a cut position, ``offsets[i]`` the
    number of ids of ``text[:cuts[i]]`` (both ascending)."""

    __slots__ = ("text", "ids", "cuts", "offsets", "listed", "nbytes")

    def __init__(self, text: str, ids: array, cuts: array, offsets: array) -> None:
        assert len(cuts) == len(offsets)
        self.text, self.ids, self.cuts, self.offsets = text, ids, cuts, offsets
        self.listed: list[int] | None = None       # ids as a list, once a caller wanted one
        self.nbytes = (sys.getsizeof(text) + ids.itemsize * len(ids)
                       + cuts.itemsize * len(cuts) + offsets.itemsize * len(offsets) + 256)


class Reuse(NamedTuple):
    """``text[:pos]`` encodes to ``entry.ids[:offset]``, and ``pos`` is a cut of the text (or its
    end); the entry's first ``ncuts`` cut points are cut points of the text. ``extends``: the text
    starts with the entry's whole text."""

    entry: Entry
    ncuts: int
    pos: int
    offset: int
    extends: bool


def reuse_in(text: str, entry: Entry, floor: int = 0) -> Reuse | None:
    """The furthest cut (beyond ``floor``) up to which ``text`` may take ``entry``'s ids."""
    doc, cuts, offsets = entry.text, entry.cuts, entry.offsets
    n, size = len(text), len(doc)
    if n >= size and text.startswith(doc):
        if n == size or _CUT_AT.match(text, size):
            return Reuse(entry, len(cuts), size, len(entry.ids), True) if size > floor else None
        if cuts and cuts[-1] > floor:
            return Reuse(entry, len(cuts), cuts[-1], offsets[-1], True)
        return None
    lo = bisect_right(cuts, floor)            # first cut past floor
    hi = bisect_right(cuts, n - 2)            # cuts[i] + 2 <= n below hi
    if lo >= hi:
        return None
    matched = cuts[lo] + 2
    if floor and not text.startswith(doc[max(0, matched - WINDOW):matched], max(0, matched - WINDOW)):
        return None                           # (past a better candidate's cut: most differ near it)
    if not text.startswith(doc[:matched]):
        return None
    while hi - lo > 1:                        # text[:cuts[lo] + 2] matches; cuts[hi] does not (or is past n)
        mid = (lo + hi) // 2
        end = cuts[mid] + 2
        if text.startswith(doc[matched:end], matched):
            lo, matched = mid, end
        else:
            hi = mid
    return Reuse(entry, lo + 1, cuts[lo], offsets[lo], False)


class PrefixCache:
    """Entries by key, least recently used first out by bytes; thread-safe."""

    def __init__(self, max_bytes: int, key_chars: int, min_new_chars: int) -> None:
        self.max_bytes = max_bytes
        self.key_chars = key_chars
        self.min_new_chars = min_new_chars
        self._lock = threading.Lock()
        self._lru: OrderedDict[Entry, str] = OrderedDict()    # entry -> its key
        self._by_key: dict[str, list[Entry]] = {}     # least recently used first
        self.bytes = 0
        self.hits = 0                  # texts that took a remembered prefix's ids
        self.tokens_reused = 0         # ids taken so

    def __len__(self) -> int:
        return len(self._lru)

    def find(self, text: str) -> Reuse | None:
        """The longest reusable prefix of ``text`` among the entries (counted as a hit)."""
        best = self._best(text)
        if best is not None:
            with self._lock:
                key = self._lru.get(best.entry)
                if key is not None:
                    self._lru.move_to_end(best.entry)
                    same = self._by_key[key]
                    same.remove(best.entry)
                    same.append(best.entry)
                self.hits += 1
                self.tokens_reused += best.offset
        return best

    def remember(self, text: str, ids: array, cuts: array, offsets: array,
                 listed: list[int] | None = None) -> None:
        """Keep ``text`` (``ids`` = its encoding, ``cuts``/``offsets`` its cut points, ``listed``
        its ids as ``listed`` makes them, if at hand) if it adds to what the entries serve; the
        arrays and the list are the cache's from now on."""
        if len(text) < self.key_chars + 2:
            return
        entry = Entry(text, ids, cuts, offsets)
        if listed is not None:
            assert len(listed) == len(ids)
            entry.listed = listed
            entry.nbytes += 8 * len(listed)
        if entry.nbytes > self.max_bytes // 4:
            return
        best = self._best(text)
        replaced = None
        if best is not None:
            if best.extends:
                if len(text) == len(best.entry.text):
                    return                    # the same text (encoded by two threads at once)
                replaced = best.entry         # text serves all that entry served
            elif len(text) - best.pos < self.min_new_chars:
                return                        # the entry serves text nearly as well
        key = text[:self.key_chars]
        with self._lock:
            if replaced is not None and replaced in self._lru:
                self._drop(replaced)
            same = self._by_key.setdefault(key, [])
            if len(same) >= MAX_PER_KEY:
                self._drop(same[0])
                same = self._by_key.setdefault(key, [])
            same.append(entry)
            self._lru[entry] = key
            self.bytes += entry.nbytes
            self._evict()

    def clear(self) -> None:
        with self._lock:
            self._lru.clear()
            self._by_key.clear()
            self.bytes = 0

    def listed(self, entry: Entry, to_list: Callable[[array], list[int]]) -> list[int]:
        """``entry``'s ids as a list (``to_list(entry.ids)``, made on the first call and kept with
        the entry, its 8 bytes an id counted): a list of a remembered prefix then costs a slice."""
        ids = entry.listed
        if ids is None:
            ids = to_list(entry.ids)
            with self._lock:
                if entry.listed is None and entry in self._lru:
                    entry.listed = ids
                    entry.nbytes += 8 * len(ids)
                    self.bytes += 8 * len(ids)
                    self._evict()
        return ids

    def worth_keeping(self, text: str, reuse: Reuse | None) -> bool:
        """Whether ``remember`` would keep ``text`` after ``find`` gave ``reuse`` (as things stand)."""
        return (len(text) >= self.key_chars + 2 and sys.getsizeof(text) <= self.max_bytes // 4
                and (reuse is None or reuse.extends or len(text) - reuse.pos >= self.min_new_chars))

    def _best(self, text: str) -> Reuse | None:
        if len(text) < self.key_chars + 2:
            return None
        with self._lock:
            candidates = list(self._by_key.get(text[:self.key_chars], ()))
        best = None
        for entry in reversed(candidates):    # most recently used first
            found = reuse_in(text, entry, 0 if best is None else best.pos)
            if found is not None:
                best = found
                if best.pos == len(text):
                    break
        return best

    def _evict(self) -> None:
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self._lru)))

    def _drop(self, entry: Entry) -> None:
        key = self._lru.pop(entry)
        same = self._by_key[key]
        same.remove(entry)
        if not same:
            del self._by_key[key]
        self.bytes -= entry.nbytes

