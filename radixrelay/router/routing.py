"""Which replica gets a request.

Modes:
- ``precise``: as approximate, but matched tokens are the prompt's leading pages the replica reports
  holding (its KV events, ``radixrelay.kv_events``), not what this router sent it, and in flight is the
  larger of this router's requests there and the requests the replica last reported running and waiting
  (other routers' included; reported every second). Pages past those on its device that the replica
  holds in host memory or on disk count too, each token at the share of its prefill a load saves
  (``tier_tokens``: from the replica's reported prefill, host-load and disk-read rates).
- ``approximate``: each healthy replica scores ``matched_tokens - LOAD_TOKENS x in_flight`` (matched:
  the prompt's leading tokens the router sent it before, ``PrefixIndex``; in flight: this router's
  requests not yet answered there); the best score wins, ties go to the replica with fewer requests in
  flight, then to the next in turn. A replica holding a long prefix keeps it against a moderately busier
  one; with nothing matched anywhere, the least loaded wins.
- ``round-robin``: the healthy replicas in turn (for comparison).

In every mode a request with a ``prompt_cache_key`` (OpenAI's field) goes to the replica the last request
with the same key (and ``cache_salt``) went to, while that replica is healthy (``CacheKeyAffinity``): the
client says those requests share a prefix, so one replica computes and holds it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from radixrelay.kv_schema import Load

MODES = ("precise", "approximate", "round-robin")
# A token in a replica's host memory, when the replica has reported no rates yet, counts as this share of
# one on its device (a load from host memory runs several times faster than the prefill it replaces); a
# token on disk counts only by measured rates.
HOST_SHARE_UNKNOWN = 0.5
# Tokens of cached prefix one request in flight is worth: ~ the prefill one queued request costs a replica.
LOAD_TOKENS = 256


@dataclass(frozen=True)
class Candidate:
    replica: str
    matched_tokens: int
    in_flight: int


def tier_tokens(device: int, host: int, disk: int, load: Load | None) -> int:
    """Matched tokens worth ``device`` on the device plus ``host`` in host memory and ``disk`` on disk after
    them: a lower tier's token counts as the share of its prefill time its load saves, ``1 - t_load /
    t_prefill`` (a disk page is read into host memory, then loaded), 0 where loading is slower."""
    host_share, disk_share = HOST_SHARE_UNKNOWN, 0.0
    if load is not None and load.prefill_tps and load.host_load_tps:
        host_share = max(0.0, 1.0 - load.prefill_tps / load.host_load_tps)
        if load.disk_read_tps:
            disk_share = max(0.0, 1.0 - load.prefill_tps * (1.0 / load.disk_read_tps + 1.0 / load.host_load_tps))
    return device + int(host * host_share + disk * disk_share)


def choose(mode: str, candidates: list[Candidate], turn: int) -> Candidate:
    """The replica for one request among ``candidates`` (healthy, in pool order; not empty); ``turn``: a
    counter the caller increments per request (round-robin and ties)."""
    if not candidates:
        raise ValueError("choose: no candidates")
    n = len(candidates)
    rotated = [candidates[(turn + i) % n] for i in range(n)]
    if mode == "round-robin":
        return rotated[0]
    if mode not in ("precise", "approximate"):
        raise ValueError(f"routing mode must be one of {MODES}, got {mode!r}")
    return max(rotated, key=lambda c: (c.matched_tokens - LOAD_TOKENS * c.in_flight, -c.in_flight))


class CacheKeyAffinity:
    """``prompt_cache_key`` (under a salt) -> the replica its requests go to; the ``capacity`` most recently
    used keys are kept."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        if capacity < 1:
            raise ValueError(f"CacheKeyAffinity: capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._replica: OrderedDict[tuple[str | None, str], str] = OrderedDict()

    def get(self, key: tuple[str | None, str]) -> str | None:
        replica = self._replica.get(key)
        if replica is not None:
            self._replica.move_to_end(key)
        return replica

    def set(self, key: tuple[str | None, str], replica: str) -> None:
        self._replica[key] = replica
        self._replica.move_to_end(key)
        while len(self._replica) > self.capacity:
            self._replica.popitem(last=False)

    def drop(self, replica: str) -> None:
        """``replica`` left the pool: its keys go elsewhere next time."""
        for key in [k for k, r in self._replica.items() if r == replica]:
            del self._replica[key]

    def __len__(self) -> int:
        return len(self._replica)
