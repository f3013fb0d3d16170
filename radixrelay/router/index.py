"""The approximate routing index: per replica, the page keys of the prompts this router sent there.

A page key names a whole prefix (``radixrelay.radix.page_keys``: key i chains every token up to the
end of page i), so a replica "holds" a prompt's first n pages when it was sent a prompt with the same
first n keys. It may have evicted them since: the index is a guess, kept fresh by least-recently-used
trimming at ``capacity`` keys per replica and emptied when the replica leaves the pool.
"""

from __future__ import annotations

from collections import OrderedDict


class PrefixIndex:
    def __init__(self, capacity: int = 1 << 20) -> None:
        if capacity < 1:
            raise ValueError(f"PrefixIndex: capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._keys: dict[str, OrderedDict[bytes, None]] = {}

    def record(self, replica: str, keys: list[bytes]) -> None:
        """``replica`` was sent a prompt whose page keys are ``keys``."""
        held = self._keys.setdefault(replica, OrderedDict())
        for key in keys:
            held[key] = None
            held.move_to_end(key)
        while len(held) > self.capacity:
            held.popitem(last=False)

    def matched(self, replica: str, keys: list[bytes]) -> int:
        """How many of ``keys``' leading pages ``replica`` was sent (0 for an unknown replica)."""
        held = self._keys.get(replica)
        if not held:
            return 0
        n = 0
        for key in keys:
            if key not in held:
                break
            n += 1
        return n

    def drop(self, replica: str) -> None:
        """Forget ``replica`` (it left the pool: what it held is lost or stale)."""
        self._keys.pop(replica, None)

    def size(self, replica: str) -> int:
        return len(self._keys.get(replica, ()))
