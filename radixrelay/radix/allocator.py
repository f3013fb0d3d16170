"""KV page allocator: hands out page ids; the KV memory itself lives with the model.

A page holds ``page_size`` consecutive token slots (docs/kv_layout.md). The allocator only tracks
which page ids are free. Allocation order is deterministic (a FIFO free list, initially ascending),
so tests can assert exact page ids.

Invariant: every page id in ``[0, num_pages)`` is either in the free list exactly once or owned by
exactly one holder (a running request or a radix-tree node); ``free`` rejects double frees.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"PageAllocator: num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._is_free = bytearray(b"\x01") * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """``n`` pages, oldest-freed first; None (taking nothing) when fewer than ``n`` are free."""
        if n < 0:
            raise ValueError(f"PageAllocator.alloc: n must be >= 0, got {n}")
        if n > len(self._free):
            return None
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._is_free[p] = 0
        return pages

    def free(self, pages: Iterable[int]) -> None:
        for p in pages:
            if not 0 <= p < self.num_pages:
                raise ValueError(f"PageAllocator.free: page {p} out of range [0, {self.num_pages})")
            if self._is_free[p]:
                raise ValueError(f"PageAllocator.free: page {p} is already free")
            self._is_free[p] = 1
            self._free.append(p)

    def free_pages(self) -> list[int]:
        """Snapshot of the free list (for integrity checks and tests)."""
        return list(self._free)

    def check_integrity(self) -> None:
        free = self._free
        if len(set(free)) != len(free):
            raise AssertionError("PageAllocator: duplicate page in the free list")
        if sum(self._is_free) != len(free) or any(not self._is_free[p] for p in free):
            raise AssertionError("PageAllocator: free flags disagree with the free list")
