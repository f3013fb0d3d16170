"""The counters structs each process reports (``StatsReply``, ``/metrics``): the scheduler's, the KV audit,
garbage collection, and the runtime's totals that carry them."""

from __future__ import annotations

import msgspec


class SchedulerStats(msgspec.Struct, frozen=True):
    num_running: int
    num_waiting: int
    kv_total_pages: int
    kv_free_pages: int
    kv_used_pages: int                          # held by running requests or the tree
    cached_tokens: int                          # in the radix tree
    evictable_tokens: int
    locked_tokens: int
    cache_hit_tokens: int                       # cumulative prompt tokens served from the cache
    prompt_tokens: int                          # cumulative prompt tokens of first admissions
    num_retractions: int
    # -- KV tiers (0 without): pages held, prompt tokens served, bytes moved, load time --------
    tier_host_pages: int = 0
    tier_host_used_pages: int = 0
    tier_disk_pages: int = 0
    tier_disk_used_pages: int = 0
    tier_host_hit_tokens: int = 0               # prompt tokens promoted from host memory
    tier_disk_hit_tokens: int = 0               # of which read from disk ahead of the turn
    tier_repositioned_tokens: int = 0           # of which re-positioned for a truncated prompt
    tier_prefetch_used_pages: int = 0
    tier_read_failed_pages: int = 0             # disk pages found missing or corrupt: misses
    tier_saved_bytes: int = 0                   # device -> host
    tier_loaded_bytes: int = 0                  # host -> device
    tier_written_bytes: int = 0                 # host -> disk
    tier_read_bytes: int = 0                    # disk -> host
    tier_load_s: float = 0.0                    # device seconds of host -> device loads
    tier_load_exposed_s: float = 0.0            # of which steps waited for

    @property
    def kv_usage(self) -> float:
        return self.kv_used_pages / self.kv_total_pages


class KVAudit(msgspec.Struct, frozen=True):
    total_pages: int
    free_pages: int
    cached_pages: int                 # held by radix-tree nodes (locked or evictable)
    request_pages: int                # private pages of running requests (beyond their locked path)
    locked_nodes: int                 # radix nodes with lock_ref > 0
    lock_refs: int                    # lock_ref summed over nodes (a lock counts once per node of its path)
    lock_holders: int                 # running requests holding a lock on their matched path
    live_requests: int                # running + waiting
    integrity_error: str | None = None   # check_integrity's failure, None when every invariant holds
    integrity_age_s: float = 0.0         # seconds since that verdict was computed (0: by this audit)

    @property
    def integrity_ok(self) -> bool:
        return self.integrity_error is None

    @property
    def at_idle_baseline(self) -> bool:
        """No live request and nothing held on behalf of one (see ``radixrelay.scheduler.audit``)."""
        return (self.live_requests == 0 and self.request_pages == 0 and self.locked_nodes == 0
                and self.lock_refs == 0 and self.lock_holders == 0
                and self.free_pages + self.cached_pages == self.total_pages and self.integrity_ok)


class GcStats(msgspec.Struct, frozen=True):
    """One process's collections since start (cumulative)."""
    seconds: float = 0.0          # time inside the collector
    collections: int = 0          # collections of any generation
    full_collections: int = 0     # of which generation 2
    longest_s: float = 0.0        # longest single pause
    frozen: int = 0               # objects frozen at start-up (managed mode; 0 otherwise)


class RuntimeStats(msgspec.Struct, frozen=True):
    scheduler: SchedulerStats
    steps: int                        # steps the worker ran
    computed_tokens: int              # tokens run through the model (cache hits excluded)
    decode_steps: int                 # steps with at least one decode row
    cascade_steps: int                # decode steps that carried a cascade plan
    cascade_groups: int = 0           # cascade groups summed over steps
    cascade_levels: int = 0           # cascade levels summed over steps
    cascade_tokens_read_once: int = 0  # KV token reads saved: (members - 1) * tokens, per group and step
    # Where the serving loop's time goes (seconds, summed over steps; with overlap the worker's host
    # work, the scheduler's and the device's run at the same time):
    worker_busy_s: float = 0.0        # worker host time on steps (launch + waiting for and reading results)
    worker_launch_s: float = 0.0      # of which host work before the model's kernels were all launched
    scheduler_busy_s: float = 0.0     # scheduling steps and processing their outputs
    worker_device_s: float = 0.0      # device time of the steps (device busy fraction = this / wall time)
    jit_after_ready: int = 0          # Triton kernel variants compiled (or loaded) after ready: 0 expected
    graph_captures: int = 0           # CUDA graphs captured (start-up included)
    graph_replays: int = 0            # steps that replayed a CUDA graph
    eager_steps: int = 0              # steps whose forward ran eagerly
    # Prefill cascade (extend rows reading a cached run shared between requests once, decided per step by
    # the worker), cumulative:
    prefill_cascade_steps: int = 0
    prefill_cascade_runs: int = 0
    prefill_cascade_tokens_read_once: int = 0
    prefill_long_prefix_runs: int = 0  # long cached prefixes of short extends read split along their length
    # KV pages and radix locks by holder, and check_integrity's verdict, taken when these stats were
    # asked for (None from a runtime that does not audit):
    kv_audit: KVAudit | None = None
    # Frames dropped because they did not decode as their channel's messages (garbage, truncated,
    # another channel's message), cumulative over the scheduler, the worker (as of its latest step
    # output) and the frontend's inbox:
    malformed_frames: int = 0
    # Decode-graph steps (cumulative, of graph_replays): advanced on the device (the previous step's rows
    # one token further: no batch packing on the host), and run on a larger graph covering their size class;
    # of the advanced ones, those whose changed rows (requests joined, left) were patched in place; and
    # decode steps of a size class no captured graph covered yet, run on the piecewise graphs instead:
    decode_steps_advanced: int = 0
    decode_steps_covered: int = 0
    decode_steps_patched: int = 0
    decode_steps_deferred: int = 0
    # Steps with decode rows and no extends (cumulative): how many, their decode rows summed, and the
    # worker's launch time on them (of worker_launch_s; mixed steps are the rest):
    decode_only_steps: int = 0
    decode_only_rows: int = 0
    decode_only_launch_s: float = 0.0    # graph captures excluded (they are in graph_capture_s)
    graph_capture_s: float = 0.0      # worker launch time spent capturing CUDA graphs (all steps)
    # Python garbage collection per process (``radixrelay.runtime.gc_control``): the worker's as of its
    # latest step output, the scheduler's, and the frontend's (filled in by the server, empty elsewhere):
    worker_gc: GcStats = GcStats()
    scheduler_gc: GcStats = GcStats()
    frontend_gc: GcStats = GcStats()
