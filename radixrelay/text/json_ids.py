"""Token-id prompts parsed from their JSON text, in C and reused by prefix.

A flat JSON array of non-negative integers is parsed straight into int64 ``[n]`` (no Python int per
id). Clients that ask many questions about one document send its ids again in every request; the
text of the array up to the last id the new body shares with a recently parsed one is compared
(memcmp speed) instead of parsed again, and only the ids after it are parsed. A burst of 128 bodies
of 112K ids then costs the event loop one parse of the document, not 128.

Invariant: the result equals a fresh parse of the whole text, always. An entry is reused only up
to a comma both texts have at the same position with identical bytes before it, so the ids before it
are the same ids; the rest is parsed and checked as a fresh body would be."""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

_PLAIN = b"0123456789,\t\n\r "       # all a JSON array of non-negative integers holds inside its brackets
_INT64_MAX = np.iinfo(np.int64).max
_COMMA = 44
KEY_BYTES = 1024                     # entries are found by the first bytes of the text
MIN_CACHED_BYTES = 16 << 10          # shorter texts parse in microseconds: not kept
MAX_ENTRIES = 32
MAX_ENTRIES_PER_KEY = 4


@dataclass(frozen=True)
class _Parsed:
    text: bytes                   # the array's inside, between its brackets
    ids: np.ndarray               # int64 [n], read-only
    commas: np.ndarray            # int64 [n - 1]: the commas' positions in ``text``


class IdPrefixCache:
    """Recently parsed id arrays (``MAX_ENTRIES``, least recently used out), found by their first
    ``KEY_BYTES`` bytes. Thread-safe."""

    def __init__(self, max_entries: int = MAX_ENTRIES, min_bytes: int = MIN_CACHED_BYTES) -> None:
        self.max_entries = max_entries
        self.min_bytes = min_bytes
        self._by_key: OrderedDict[bytes, list[_Parsed]] = OrderedDict()
        self._count = 0
        self._lock = threading.Lock()
        self.reused_ids = 0           # counters, for tests and metrics
        self.parsed_ids = 0

    def parse(self, inner: bytes) -> np.ndarray | None:
        """The ids of ``inner`` (a valid JSON array's inside) if it holds only non-negative integers
        that fit int64, as a read-only int64 [n]; None for anything else (signs, floats, nesting)."""
        key = inner[:KEY_BYTES]
        with self._lock:
            candidates = list(self._by_key.get(key, ()))
        base, shared = _longest_shared(inner, candidates)
        if base is not None and shared == len(base.ids) and len(base.text) == len(inner):
            self._touch(key, base)
            with self._lock:
                self.reused_ids += len(base.ids)
            return base.ids                      # the same text
        start = 0 if base is None or shared == 0 else int(base.commas[shared - 1]) + 1
        tail = _parse_plain(inner[start:])
        if tail is None:
            return None
        tail_ids, tail_commas = tail
        if shared:
            ids = np.concatenate([base.ids[:shared], tail_ids])
            commas = np.concatenate([base.commas[:shared], tail_commas + start])
        else:
            ids, commas = tail_ids, tail_commas
        ids.flags.writeable = False
        with self._lock:
            self.reused_ids += shared
            self.parsed_ids += len(tail_ids)
        if len(inner) >= self.min_bytes:
            self._add(key, _Parsed(inner, ids, commas))
        return ids

    def _touch(self, key: bytes, entry: _Parsed) -> None:
        with self._lock:
            if key in self._by_key:
                self._by_key.move_to_end(key)

    def _add(self, key: bytes, entry: _Parsed) -> None:
        with self._lock:
            entries = self._by_key.setdefault(key, [])
            self._by_key.move_to_end(key)
            entries.insert(0, entry)
            self._count += 1
            if len(entries) > MAX_ENTRIES_PER_KEY:
                entries.pop()
                self._count -= 1
            while self._count > self.max_entries:
                _, evicted = self._by_key.popitem(last=False)
                self._count -= len(evicted)

    def __len__(self) -> int:
        with self._lock:
            return self._count


def _longest_shared(inner: bytes, candidates: list[_Parsed]) -> tuple[_Parsed | None, int]:
    """The candidate sharing the most whole ids with ``inner``, and how many: ids before a comma at
    which both texts are still identical. Byte comparisons are memcmp's (``startswith`` on views): a
    candidate is looked at only if it agrees with ``inner`` past the best one's first difference."""
    best, best_shared, best_same = None, 0, -1
    for entry in candidates:
        n = min(len(entry.text), len(inner))
        if n <= best_same or not inner.startswith(memoryview(entry.text)[:best_same + 1]):
            continue                     # differs where the best one does (or before): shares no more
        same = _first_difference(inner, entry.text, n, best_same + 1)
        # whole ids end at a comma before the first difference (or the shorter text's end, when one
        # text is a prefix of the other and the longer one has a comma right there)
        shared = int(np.searchsorted(entry.commas, same, side="left"))
        if same == len(inner) == len(entry.text):
            shared = len(entry.ids)
        if shared > best_shared:
            best, best_shared = entry, shared
        best_same = max(best_same, same)
    return best, best_shared


_CHUNK = 1 << 14


def _first_difference(a: bytes, b: bytes, n: int, known: int) -> int:
    """The first index < ``n`` where ``a`` and ``b`` differ (``n`` if none), given that their first
    ``known`` bytes agree: memcmp's of ``_CHUNK`` bytes from there on, then a binary search inside the
    chunk that differs (one pass over the shared bytes, no copies)."""
    view = memoryview(b)
    lo = known
    while lo < n:
        hi = min(lo + _CHUNK, n)
        if not a.startswith(view[lo:hi], lo):
            break
        lo = hi
    else:
        return n
    while hi - lo > 1:                   # a[:lo] == b[:lo]; a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a.startswith(view[lo:mid], lo):
            lo = mid
        else:
            hi = mid
    return lo


def _parse_plain(inner: bytes) -> tuple[np.ndarray, np.ndarray] | None:
    """(ids int64 [n], comma positions [n - 1]) of a text of only digits, commas and whitespace; None
    for any other character, a count that does not add up, or an id past int64 (``fromstring``
    saturates those)."""
    chars = np.frombuffer(inner, dtype=np.uint8)
    commas = chars == _COMMA
    digits = (chars - np.uint8(48)) < 10
    if not (digits | commas | (chars == 32)).all() and inner.translate(None, _PLAIN):
        return None                      # a character besides digits, commas, spaces (and \t \n \r)
    positions = np.flatnonzero(commas)
    # JSON's grammar, which nothing checked before when the text was cut out of a body
    # (``split_prompt``): one number between each two commas ("1 2", "1,,2" are not arrays), no
    # leading zeros ("01")
    starts = digits.copy()
    starts[1:] &= ~digits[:-1]
    if np.count_nonzero(starts) != len(positions) + 1:
        return None
    if (starts[:-1] & (chars[:-1] == 48) & digits[1:]).any():
        return None
    ids = np.fromstring(inner, dtype=np.int64, sep=",")
    if len(ids) != len(positions) + 1 or (ids == _INT64_MAX).any():
        return None
    return ids, positions


_SHARED = IdPrefixCache()
_PROMPT_KEY = b'"prompt"'
_OPENS_ARRAY = re.compile(rb"\s*:\s*\[")
PLACEHOLDER = b"0"


def split_prompt(body: bytes) -> tuple[bytes, np.ndarray] | None:
    """A JSON object's flat token-id ``prompt`` cut out before the rest is decoded, so that no JSON
    decoder scans its ids: (the body with ``PLACEHOLDER`` in the array's place, the ids as
    ``plain_ids`` gives them). None where that cannot be done safely: a body naming "prompt" more than
    once (a nested key or a string value that may be it), anything but a flat array of non-negative
    integers after the key. The caller decodes the rest and takes the ids only if its top-level
    ``prompt`` is the placeholder (the key it found may be a nested object's). Inside a JSON string the
    quotes around "prompt" would be escaped, so each occurrence found is a key or that exact string."""
    at = body.find(_PROMPT_KEY)
    if at < 0 or body.find(_PROMPT_KEY, at + 1) >= 0:
        return None
    opened = _OPENS_ARRAY.match(body, at + len(_PROMPT_KEY))
    if opened is None:
        return None
    end = body.find(b"]", opened.end())
    if end < 0:
        return None
    ids = _SHARED.parse(body[opened.end():end])
    if ids is None:
        return None
    return body[:opened.end() - 1] + PLACEHOLDER + body[end + 1:], ids


def plain_ids(raw: bytes | memoryview) -> np.ndarray | None:
    """The common token-id prompt, a flat JSON array of non-negative integers (``raw``: valid JSON,
    brackets included), as a read-only int64 [n], reusing this process's recently parsed prompts by
    prefix; None for any other array (decoded by type then)."""
    return _SHARED.parse(bytes(raw)[1:-1])
