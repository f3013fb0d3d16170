"""Rank 0's view of the KV transfers of every tensor-parallel rank.

Each rank copies its own KV heads between the device, host memory and disk, under the same page keys
and slots (every rank runs every plan). The scheduler may reuse a device page once its save is
acknowledged and serve a host slot once its disk read is, so rank 0 acknowledges a transfer only
once every rank reported it done, and as failed if it failed on any rank (a save that failed on one
rank left that rank's slot empty: the page is lost on every rank as far as the scheduler knows).

Invariants:
- every rank reports the transfers of the same plans in the same order (one thread per rank runs
  them in plan order), so the i-th report of a (kind, key) by one rank is the i-th of every rank;
- an item is released at most once, in the order its last report arrived;
- load timings are rank 0's own (every rank loads the same pages).
"""

from __future__ import annotations

from collections import deque

from radixrelay.protocol.kv import KVAcks


class _Pending:
    """Reports of one item so far: how many ranks reported it, and whether all of them succeeded."""

    __slots__ = ("count", "ok")

    def __init__(self) -> None:
        self.count = 0
        self.ok = True


class RankAcks:
    """Merges the ``KVAcks`` of ``ranks`` ranks into acknowledgements complete on all of them."""

    def __init__(self, ranks: int) -> None:
        if ranks < 1:
            raise ValueError(f"RankAcks: ranks must be >= 1, got {ranks}")
        self.ranks = ranks
        # (kind, key) -> the pending reports of that item, oldest first; kind "save" keys are step ids
        self._pending: dict[tuple[str, object], deque[_Pending]] = {}
        # (rank, kind, key) -> how many of that item's pending entries the rank has reported
        self._seen: dict[tuple[int, str, object], int] = {}
        self._saved: list[int] = []
        self._failed: list[int] = []
        self._disk: dict[str, list[bytes]] = {"written": [], "write_failed": [], "read": [], "read_failed": []}
        self._load_s = self._exposed_s = self._save_s = 0.0

    def add(self, rank: int, acks: KVAcks | None) -> None:
        """Rank ``rank``'s acknowledgements (``None``: nothing completed)."""
        if not 0 <= rank < self.ranks:
            raise ValueError(f"RankAcks: rank {rank} out of range for {self.ranks} ranks")
        if acks is None:
            return
        for items, kind, ok in ((acks.saved_steps, "save", True), (acks.failed_steps, "save", False),
                                (acks.written, "write", True), (acks.write_failed, "write", False),
                                (acks.read, "read", True), (acks.read_failed, "read", False)):
            for item in items:
                self._report(rank, kind, item, ok)
        if rank == 0:
            self._load_s += acks.load_s
            self._exposed_s += acks.load_exposed_s
            self._save_s += acks.save_s

    def take(self) -> KVAcks | None:
        """What completed on every rank since the last call, or None."""
        disk = self._disk
        if not (self._saved or self._failed or self._load_s or self._save_s or any(disk.values())):
            return None
        out = KVAcks(self._saved, self._failed, disk["written"], disk["write_failed"], disk["read"],
                     disk["read_failed"], self._load_s, self._exposed_s, self._save_s)
        self._saved, self._failed = [], []
        self._disk = {name: [] for name in disk}
        self._load_s = self._exposed_s = self._save_s = 0.0
        return out

    def pending(self) -> int:
        """Items some rank reported and another has not yet."""
        return sum(len(q) for q in self._pending.values())

    def _report(self, rank: int, kind: str, key: object, ok: bool) -> None:
        queue = self._pending.setdefault((kind, key), deque())
        seen = self._seen.get((rank, kind, key), 0)
        if seen == len(queue):
            queue.append(_Pending())
        entry = queue[seen]
        entry.count += 1
        entry.ok = entry.ok and ok
        self._seen[(rank, kind, key)] = seen + 1
        while queue and queue[0].count == self.ranks:
            self._release(kind, key, queue.popleft().ok)
            for r in range(self.ranks):
                left = self._seen.get((r, kind, key), 0) - 1
                if left > 0:
                    self._seen[(r, kind, key)] = left
                else:
                    self._seen.pop((r, kind, key), None)
        if not queue:
            del self._pending[(kind, key)]

    def _release(self, kind: str, key: object, ok: bool) -> None:
        if kind == "save":
            (self._saved if ok else self._failed).append(key)
        elif kind == "write":
            self._disk["written" if ok else "write_failed"].append(key)
        else:
            self._disk["read" if ok else "read_failed"].append(key)
