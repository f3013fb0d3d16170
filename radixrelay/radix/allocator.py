"""KV page allocator: hands out page ids; the KV memory itself lives with the model.

A page holds ``page_size`` consecutive token slots (docs/kv_layout.md). The allocator only tracks
which page ids are free, as runs of consecutive ids, and hands a request's prompt pages out as ONE
run where a long enough run is free: a shared radix node laid out on consecutive pages is one strided
block of the KV cache, which the shared-node kernel loads by TMA on Hopper (faster than gathering
page by page; benchmarks/results/kernels/attention.md).

Policy (deterministic, so tests can assert exact page ids):
- ``alloc(n)``: the shortest free run of at least ``n`` pages (lowest first id among equals), its
  first ``n`` pages; if no run is that long, the longest runs first (fewest pieces).
- ``alloc(n, one_run=False)`` (pages for different requests, e.g. one more page for each decoding
  request): single pages from the shortest runs first, keeping the long runs whole.
- ``free``: freed ids merge with their free neighbours into longer runs.

Invariant: every page id in ``[0, num_pages)`` is either free (inside exactly one run) or owned by
exactly one holder (a running request or a radix-tree node); ``free`` rejects double frees.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"PageAllocator: num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self._is_free = bytearray(b"\x01") * num_pages
        self._num_free = 0
        self._length: dict[int, int] = {}          # run start -> length
        self._start_of_end: dict[int, int] = {}    # run end (exclusive) -> start
        self._by_length: list[tuple[int, int]] = []  # (length, start), sorted
        self._add_run(0, num_pages)

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def longest_run(self) -> int:
        """Length of the longest free run (0 when nothing is free)."""
        return self._by_length[-1][0] if self._by_length else 0

    def alloc(self, n: int, *, one_run: bool = True) -> list[int] | None:
        """``n`` pages (see the module docstring for which); None, taking nothing, when fewer than
        ``n`` are free."""
        if n < 0:
            raise ValueError(f"PageAllocator.alloc: n must be >= 0, got {n}")
        if n > self._num_free:
            return None
        pages: list[int] = []
        if not one_run:
            while len(pages) < n:
                length, start = self._by_length[0]
                take = min(length, n - len(pages))
                pages.extend(self._take(start, length, take))
        else:
            i = bisect.bisect_left(self._by_length, (n, -1))
            if i < len(self._by_length):
                length, start = self._by_length[i]
                pages = self._take(start, length, n)
            else:
                while len(pages) < n:
                    length, start = self._by_length[-1]
                    pages.extend(self._take(start, length, min(length, n - len(pages))))
        for p in pages:
            self._is_free[p] = 0
        return pages

    def free(self, pages: Iterable[int]) -> None:
        pages = list(pages)
        seen = set()
        for p in pages:
            if not 0 <= p < self.num_pages:
                raise ValueError(f"PageAllocator.free: page {p} out of range [0, {self.num_pages})")
            if self._is_free[p] or p in seen:
                raise ValueError(f"PageAllocator.free: page {p} is already free")
            seen.add(p)
        pages.sort()
        i = 0
        while i < len(pages):
            j = i + 1
            while j < len(pages) and pages[j] == pages[j - 1] + 1:
                j += 1
            start, end = pages[i], pages[j - 1] + 1
            for p in range(start, end):
                self._is_free[p] = 1
            left = self._start_of_end.get(start)
            if left is not None:                      # a free run ends where this one starts
                self._remove_run(left)
                start = left
            if end in self._length:                   # a free run starts where this one ends
                end += self._remove_run(end)
            self._add_run(start, end - start)
            i = j

    def free_pages(self) -> list[int]:
        """Snapshot of the free page ids, ascending (for integrity checks and tests)."""
        return [p for start in sorted(self._length) for p in range(start, start + self._length[start])]

    def free_runs(self) -> list[tuple[int, int]]:
        """The free runs as (first id, length), ascending by first id."""
        return sorted(self._length.items())

    def check_integrity(self) -> None:
        runs = self.free_runs()
        if sorted((n, s) for s, n in runs) != self._by_length:
            raise AssertionError("PageAllocator: the length index disagrees with the runs")
        if {s + n: s for s, n in runs} != self._start_of_end:
            raise AssertionError("PageAllocator: the run-end index disagrees with the runs")
        for (s, n), (s2, _) in zip(runs, runs[1:]):
            if n < 1 or s + n >= s2:
                raise AssertionError(f"PageAllocator: runs at {s} and {s2} overlap, touch or are empty")
        free = self.free_pages()
        if len(free) != self._num_free or sum(self._is_free) != len(free) or any(not self._is_free[p] for p in free):
            raise AssertionError("PageAllocator: free flags disagree with the free runs")

    # -- runs ----------------------------------------------------------------------------------------

    def _add_run(self, start: int, length: int) -> None:
        self._length[start] = length
        self._start_of_end[start + length] = start
        bisect.insort(self._by_length, (length, start))
        self._num_free += length

    def _remove_run(self, start: int) -> int:
        length = self._length.pop(start)
        del self._start_of_end[start + length]
        del self._by_length[bisect.bisect_left(self._by_length, (length, start))]
        self._num_free -= length
        return length

    def _take(self, start: int, length: int, n: int) -> list[int]:
        """The first ``n`` pages of the free run at ``start``; the rest stays a run."""
        self._remove_run(start)
        if n < length:
            self._add_run(start + n, length - n)
        return list(range(start, start + n))
