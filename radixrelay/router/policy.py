"""Which replica gets a request.

Modes:
- ``precise``: as approximate, but matched tokens are the prompt's leading pages the replica reports
  holding (its KV events, ``radixrelay.kv_events``), not what this router sent it, and in flight is the
  larger of this router's requests there and the requests the replica last reported running and waiting
  (other routers' included; reported every second).
- ``approximate``: each healthy replica scores ``matched_tokens - LOAD_TOKENS x in_flight`` (matched:
  the prompt's leading tokens the router sent it before, ``PrefixIndex``; in flight: this router's
  requests not yet answered there); the best score wins, ties go to the replica with fewer requests in
  flight, then to the next in turn. A replica holding a long prefix keeps it against a moderately busier
  one; with nothing matched anywhere, the least loaded wins.
- ``round-robin``: the healthy replicas in turn (for comparison).
"""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("precise", "approximate", "round-robin")
# Tokens of cached prefix one request in flight is worth: ~ the prefill one queued request costs a replica.
LOAD_TOKENS = 256


@dataclass(frozen=True)
class Candidate:
    replica: str
    matched_tokens: int
    in_flight: int


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
