"""Scheduler configuration: one frozen dataclass, validated at construction (ValueError)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SchedulePolicy = Literal["lpm", "dfs-weight", "fcfs"]
_POLICIES = ("lpm", "dfs-weight", "fcfs")


@dataclass(frozen=True)
class SchedulerConfig:
    kv_cache_tokens: int                      # KV capacity in token slots (rounded down to pages)
    # Tokens per KV page. 16 by measurement (benchmarks/engine/bench_radix_page_size.py, multi-turn
    # chats over shared system prompts): the scheduler's CPU time per generated token falls with the
    # page size and is flat past 16, while the prefix-hit rate, which loses the partial last page of
    # every request, falls as pages grow.
    page_size: int = 16
    max_running_requests: int = 256
    # Per-step token budget: decode rows are counted first (and never dropped), extend chunks
    # get the rest.
    chunked_prefill_tokens: int = 8192
    schedule_policy: SchedulePolicy = "lpm"
    policy_queue_limit: int = 128             # longer waiting queues fall back to FCFS order
    disable_radix_cache: bool = False
    # Admission keeps this fraction of every running request's remaining max_tokens in reserve for
    # decode growth; when the guess is too low, decode retracts requests instead of failing.
    decode_reservation_ratio: float = 0.3
    eos_token_ids: tuple[int, ...] = ()
    # Model + KV layout identity: seeds the content keys of the lower KV tiers (radix/page_keys.py).
    kv_namespace: str = ""
    kv_page_bytes: int = 0                    # bytes of one page's KV (tier byte counters)
    # Waiting requests whose disk-resident pages are read into host memory ahead of their turn.
    tier_lookahead: int = 32
    # Fewest prompt tokens a request reads from disk: a shorter run is computed (cheaper than a disk
    # round trip); longer ones are read, and waited for while that is cheaper than computing them.
    disk_min_tokens: int = 64
    # Pinned prefixes (``scheduler/pins.py``): most radix-tree tokens pins may hold (0: pins are refused),
    # and a factor on every pin's time-to-live (tests shorten them).
    pinned_kv_tokens: int = 0
    pin_ttl_scale: float = 1.0
    # Request priorities (smaller first): refused unless enabled. A queued request gains one priority level
    # for every ``priority_ageing_s`` seconds it has waited, so no request starves.
    enable_priority: bool = False
    priority_ageing_s: float = 5.0

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> ValueError:
            return ValueError(f"SchedulerConfig.{field}: {why}")

        if self.page_size < 1:
            raise bad("page_size", f"must be >= 1, got {self.page_size}")
        if self.kv_cache_tokens < self.page_size:
            raise bad("kv_cache_tokens", f"must hold at least one page ({self.page_size} tokens), "
                                         f"got {self.kv_cache_tokens}")
        if self.max_running_requests < 1:
            raise bad("max_running_requests", f"must be >= 1, got {self.max_running_requests}")
        if self.chunked_prefill_tokens < 1:
            raise bad("chunked_prefill_tokens", f"must be >= 1, got {self.chunked_prefill_tokens}")
        if self.schedule_policy not in _POLICIES:
            raise bad("schedule_policy",
                      f"must be one of {_POLICIES}, got {self.schedule_policy!r}")
        if self.disk_min_tokens < 0:
            raise bad("disk_min_tokens", f"must be >= 0, got {self.disk_min_tokens}")
        if self.policy_queue_limit < 0:
            raise bad("policy_queue_limit", f"must be >= 0, got {self.policy_queue_limit}")
        if not 0 <= self.pinned_kv_tokens <= self.kv_cache_tokens:
            raise bad("pinned_kv_tokens", f"must be in [0, kv_cache_tokens = {self.kv_cache_tokens}], "
                                          f"got {self.pinned_kv_tokens}")
        if not self.pin_ttl_scale > 0:
            raise bad("pin_ttl_scale", f"must be > 0, got {self.pin_ttl_scale}")
        if not self.priority_ageing_s > 0:
            raise bad("priority_ageing_s", f"must be > 0, got {self.priority_ageing_s}")
        if not 0 <= self.decode_reservation_ratio <= 1:
            raise bad("decode_reservation_ratio",
                      f"must be in [0, 1], got {self.decode_reservation_ratio}")

    @property
    def num_pages(self) -> int:
        return self.kv_cache_tokens // self.page_size

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` token slots."""
        return -(-num_tokens // self.page_size)
