"""Pieces of text with their ids, by the piece's text (``encode_cache.ChunkedEncoder``'s chunks),
encoded once however many threads ask at the same time.

A piece missing from the cache is claimed by the first thread that asks for it (a flight) and
encoded by that thread with the others of its batch in one ``encode_batch`` call, outside the lock;
a thread asking for a piece in flight waits for that thread's ids instead of encoding it again. A
thread waits only after its own claims are settled, so no two threads wait on each other. If an
encode fails, its waiters encode the piece themselves. Bounded by tokens and by bytes (piece texts
plus 4 bytes an id), least recently used first out.
"""

from __future__ import annotations

import sys
import threading
from array import array
from collections import OrderedDict

from tokenizers import Tokenizer as HFTokenizer


class _Flight:
    """A piece one thread is encoding; the others wait for its ids (None: that encode failed)."""

    __slots__ = ("done", "ids")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.ids: array[int] | None = None


class ChunkCache:
    def __init__(self, tok: HFTokenizer, max_tokens: int, max_bytes: int) -> None:
        self._tok = tok
        self.max_tokens = max_tokens
        self.max_bytes = max_bytes
        self._cache: OrderedDict[str, array[int]] = OrderedDict()
        self._flights: dict[str, _Flight] = {}
        self._lock = threading.Lock()
        self.tokens = 0               # ids held
        self.bytes = 0
        self.hits = 0                 # pieces served from the cache
        self.misses = 0               # pieces encoded
        self.shared = 0               # pieces another thread was encoding, waited for
        self.tokens_encoded = 0

    def ids(self, pieces: list[str], cache: bool = True) -> list[array[int]]:
        """Each piece's ids (arrays the cache may hold: not to be changed); ``cache``: keep the
        ones encoded here."""
        found: list[array[int] | None] = []
        mine: dict[str, _Flight] = {}
        theirs: dict[str, _Flight] = {}
        with self._lock:
            for p in pieces:
                ids = self._cache.get(p)
                found.append(ids)
                if ids is not None:
                    self._cache.move_to_end(p)
                    self.hits += 1
                elif p not in mine and p not in theirs:
                    flight = self._flights.get(p)
                    if flight is None:
                        mine[p] = self._flights[p] = _Flight()
                    else:
                        theirs[p] = flight
                        self.shared += 1
        fresh: dict[str, array[int]] = {}
        if mine:
            try:
                encodings = self._tok.encode_batch(list(mine), add_special_tokens=False)
                fresh = {p: array("I", e.ids) for p, e in zip(mine, encodings)}
            finally:
                with self._lock:
                    for p in mine:
                        del self._flights[p]
                    self.misses += len(fresh)
                    self.tokens_encoded += sum(map(len, fresh.values()))
                    if cache:
                        for p, ids in fresh.items():
                            self._put(p, ids)
                for p, flight in mine.items():
                    flight.ids = fresh.get(p)
                    flight.done.set()
        for p, flight in theirs.items():
            flight.done.wait()
            ids = flight.ids
            if ids is None:                          # its encode failed: encode it here
                ids = array("I", self._tok.encode(p, add_special_tokens=False).ids)
            fresh[p] = ids
        return [fresh[p] if ids is None else ids for p, ids in zip(pieces, found)]

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()
            self.tokens = self.bytes = 0

    def _put(self, piece: str, ids: array[int]) -> None:
        size = sys.getsizeof(piece) + 4 * len(ids)
        if piece in self._cache or len(ids) > self.max_tokens or size > self.max_bytes:
            return
        self._cache[piece] = ids
        self.tokens += len(ids)
        self.bytes += size
        while self._cache and (self.tokens > self.max_tokens or self.bytes > self.max_bytes):
            old_piece, old = self._cache.popitem(last=False)
            self.tokens -= len(old)
            self.bytes -= sys.getsizeof(old_piece) + 4 * len(old)
