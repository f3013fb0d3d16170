"""A KV-event publisher (``scheduler.kv_event_hook.Publisher``) that keeps what it was told, in order."""

from __future__ import annotations


class RecordingPublisher:
    def __init__(self) -> None:
        self.log: list[tuple[str, str, tuple[bytes, ...]]] = []     # (kind, tier or "", keys), in order
        self.stored_log: list[bytes] = []        # device stores and removals, flattened
        self.removed_log: list[bytes] = []
        self.loads: list[tuple[int, int, float, dict[str, float] | None]] = []

    def stored(self, keys: list[bytes]) -> None:
        self.log.append(("stored", "", tuple(keys)))
        self.stored_log.extend(keys)

    def removed(self, keys: list[bytes]) -> None:
        self.log.append(("removed", "", tuple(keys)))
        self.removed_log.extend(keys)

    def cleared(self) -> None:
        self.log.append(("cleared", "", ()))

    def tier_stored(self, tier: str, keys: list[bytes]) -> None:
        self.log.append(("tier_stored", tier, tuple(keys)))

    def tier_removed(self, tier: str, keys: list[bytes]) -> None:
        self.log.append(("tier_removed", tier, tuple(keys)))

    def tier_cleared(self, tier: str) -> None:
        self.log.append(("tier_cleared", tier, ()))

    def load(self, running: int, waiting: int, kv_usage: float, rates: dict[str, float] | None = None) -> None:
        self.loads.append((running, waiting, kv_usage, rates))
