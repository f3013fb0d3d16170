"""KV tier transfers: what the scheduler asks the worker to copy between device pages and the lower tiers
(host memory, disk) with a step (``StepPlan.transfers``), and what the worker reports done
(``StepOutput.kv_acks``)."""

from __future__ import annotations

import msgspec


class KVTransfers(msgspec.Struct, frozen=True):
    """Copies between device KV pages and the lower tiers (``radixrelay.radix.tiers``), applied by the
    worker before the step's forward (disk jobs: deletes, then writes, then reads). Every copy touching a host slot runs after every
    earlier one touching host slots (plan order), so the scheduler may reuse a slot in a later plan.

    - ``saves`` read device pages written by earlier steps (never by this one); the scheduler keeps
      those pages allocated until the step's save is acknowledged (``KVAcks.saved_steps``);
    - ``loads`` fill device pages that this step (or a later one) reads; they start after the steps
      queued before, unless ``loads_start_now``;
    - disk writes read a host slot after its save; disk reads fill a slot that no load reads before
      ``KVAcks.read`` says so."""
    saves: list[tuple[int, int]] = []         # (device page, host slot)
    loads: list[tuple[int, int]] = []         # (host slot, device page)
    disk_writes: list[tuple[int, bytes]] = []  # (host slot, page key)
    disk_reads: list[tuple[bytes, int]] = []   # (page key, host slot)
    disk_deletes: list[bytes] = []            # page keys
    # loads whose keys are rotated by a position delta after the copy (RoPE; a truncated prompt's
    # KV re-positioned, ``radixrelay.radix.truncation``): (host slot, device page, delta)
    shifted_loads: list[tuple[int, int, int]] = []
    # True: no step still in flight writes the loads' device pages (``CacheManager``: freed pages cool),
    # so the loads start at once, beside the steps queued before this one; False: after them
    loads_start_now: bool = False


class KVAcks(msgspec.Struct, frozen=True):
    """Transfers that completed since the previous output (each is acknowledged exactly once). A plan
    without rows returns once all of its transfers (and earlier ones) completed, or earlier (a new plan
    arrived, or 50 ms passed) with those done so far."""
    saved_steps: list[int] = []               # steps whose saves are complete in host memory
    failed_steps: list[int] = []              # steps whose saves failed: their slots hold nothing
    written: list[bytes] = []                 # page keys now on disk
    write_failed: list[bytes] = []
    read: list[bytes] = []                    # page keys read from disk into their host slot
    read_failed: list[bytes] = []             # missing, truncated or corrupted: a miss
    load_s: float = 0.0                       # device seconds of host->device loads (CUDA events)
    load_exposed_s: float = 0.0               # of which the step's forward waited for
    save_s: float = 0.0                       # device seconds of device->host saves (CUDA events; CPU: wall)
