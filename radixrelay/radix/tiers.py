"""Lower KV tiers behind the radix tree: host memory and disk, indexed by page content keys.

The device tier is the radix tree (``tree.py``); below it, pages are content-addressed by
``page_keys`` (a key names a whole prefix under one salt and one model + layout), so these tiers need
no tree: a lookup walks a request's key chain and stops at the first page a tier lacks.

Lifecycle of a page's KV (AttentionStore's write-back, done once per page):
- save: when a request leaves (or ends its prefill) its whole pages are in the tree; pages whose key
  is not in host memory yet are copied device -> host (``KVTransfers.saves``) off the step's critical
  path. The tree node stays locked until the worker acknowledges the save, so a demotion never waits
  for a copy: a device eviction later just drops pages whose copy is already below.
- disk: an acknowledged host page is written to disk (when a disk tier is configured), once.
- promote: an admitted request whose next pages are in host memory gets fresh device pages and a load
  (host -> device) before its step; pages on disk are first read into host memory ahead of the
  request's turn (``prefetch``, for requests in the look-ahead window of the waiting queue).
- evict: host slots are reclaimed least-recently-used first, skipping pages whose copy is in flight
  and, with the ``scheduler`` policy, pages of requests in the look-ahead window. Disk files are
  reclaimed LRU when the disk capacity is reached.

Slot states (``HostEntry``): ``saving`` (device -> host copy in flight; loads may follow it, the
worker orders them), ``ready``, ``fetching`` (disk -> host read in flight: not loadable until acked).
``writing`` marks a ready slot whose disk write is in flight (the worker reads it: not evictable).

Invariants (``check_integrity``): every host slot is free or held by exactly one entry; the number of
disk keys never exceeds the disk capacity; counts of pending work match the entries.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from radixrelay.protocol.kv import KVAcks, KVTransfers
from radixrelay.radix.allocator import PageAllocator

TierPolicy = Literal["lru", "scheduler"]
TIER_POLICIES = ("lru", "scheduler")
MAX_DROPPED = 1 << 16          # keys ``take_dropped`` remembers between calls
MAX_CHANGES = 1 << 16          # tier changes ``take_changes`` remembers between calls


@dataclass
class HostEntry:
    slot: int
    state: Literal["saving", "ready", "fetching"]
    writing: bool = False        # disk write in flight
    from_disk: bool = False      # filled by a disk read (a later promotion counts as a disk hit)


@dataclass
class TierCounters:
    """Cumulative, in pages (multiply by ``page_bytes`` for bytes)."""
    saved: int = 0               # device -> host
    loaded: int = 0              # host -> device (promotions)
    loaded_from_disk: int = 0    # of which the host copy came from disk
    loaded_at_once: int = 0      # of which the loads started beside the steps before (``KVTransfers.loads_start_now``)
    written: int = 0             # host -> disk
    read: int = 0                # disk -> host
    read_failed: int = 0         # disk misses found at read time (corrupt, truncated, missing)
    prefetch_used: int = 0       # pages read from disk ahead of a turn and then promoted
    host_evicted: int = 0
    disk_evicted: int = 0
    save_skipped: int = 0        # pages not saved: host memory full of pinned pages
    load_s: float = 0.0          # device seconds of loads, and of those the steps waited for
    load_exposed_s: float = 0.0
    save_s: float = 0.0          # device seconds of saves (device -> host)


@dataclass
class _Outbox:
    saves: list[tuple[int, int]] = field(default_factory=list)
    save_keys: list[bytes] = field(default_factory=list)
    loads: list[tuple[int, int]] = field(default_factory=list)
    shifted_loads: list[tuple[int, int, int]] = field(default_factory=list)
    disk_writes: list[tuple[int, bytes]] = field(default_factory=list)
    disk_reads: list[tuple[bytes, int]] = field(default_factory=list)
    disk_deletes: list[bytes] = field(default_factory=list)
    loads_start_now: bool = True            # every load so far may start at once (``KVTransfers``)

    def empty(self) -> bool:
        return not (self.saves or self.loads or self.shifted_loads or self.disk_writes or self.disk_reads or self.disk_deletes)


class KVTiers:
    def __init__(self, host_pages: int, disk_pages: int = 0, disk_keys: Iterable[bytes] = (),
                 policy: TierPolicy = "lru") -> None:
        if host_pages < 1:
            raise ValueError(f"KVTiers: host_pages must be >= 1, got {host_pages}")
        if disk_pages < 0:
            raise ValueError(f"KVTiers: disk_pages must be >= 0, got {disk_pages}")
        if policy not in TIER_POLICIES:
            raise ValueError(f"KVTiers: policy must be one of {TIER_POLICIES}, got {policy!r}")
        self.host_pages = host_pages
        self.disk_pages = disk_pages
        self.policy = policy
        self._slots = PageAllocator(host_pages)
        self._host: OrderedDict[bytes, HostEntry] = OrderedDict()   # least recently used first
        self._disk: OrderedDict[bytes, None] = OrderedDict()        # keys on disk, LRU first
        self._stale_disk: list[bytes] = []
        for key in disk_keys:                   # found at start-up: over capacity, delete the rest
            if len(self._disk) < disk_pages:
                self._disk[key] = None
            else:
                self._stale_disk.append(key)
        self._out = _Outbox(disk_deletes=list(self._stale_disk))
        self._saving: dict[int, list[bytes]] = {}    # step id -> keys it saves
        self.epoch = 0                               # bumped whenever a key leaves host memory
        self.moves = 0                               # keys marked used so far (the LRU order's clock)
        # keys that left host memory since the last ``take_dropped`` (None: more than MAX_DROPPED, forgotten)
        self._dropped: list[bytes] | None = []
        self._num_fetching = 0
        self._num_writing = 0
        self._protected: set[bytes] = frozenset()    # look-ahead window (policy "scheduler")
        self._pinned: dict[bytes, int] = {}          # keys of pinned prefixes -> pins holding them (any policy)
        self.counters = TierCounters()
        # For KV events (``track_changes``): (tier, entered, key) in order since the last ``take_changes``;
        # ``_lost``: more than MAX_CHANGES came, the log was dropped (a snapshot is due).
        self._tracking = False
        self._changes: list[tuple[str, bool, bytes]] = []
        self._lost = False

    # -- changes, for KV events ------------------------------------------------------------------

    def track_changes(self) -> None:
        """Keep the log ``take_changes`` returns from now on (what is held already, e.g. the disk pages found
        at start-up, is ``snapshot``'s)."""
        self._tracking = True

    def take_changes(self) -> list[tuple[str, bool, bytes]] | None:
        """What entered (True) or left (False) host memory (``"host"``: a page ready there) and disk since
        the last call, in order; None when more than ``MAX_CHANGES`` did (follow with ``snapshot``)."""
        changes, self._changes = self._changes, []
        if self._lost:
            self._lost = False
            return None
        return changes

    def snapshot(self) -> tuple[list[bytes], list[bytes]]:
        """(the keys ready in host memory, the keys on disk)."""
        return [key for key, entry in self._host.items() if entry.state == "ready"], list(self._disk)

    def _changed(self, tier: str, entered: bool, key: bytes) -> None:
        if self._tracking and not self._lost:
            self._changes.append((tier, entered, key))
            if len(self._changes) > MAX_CHANGES:
                self._changes, self._lost = [], True

    # -- lookups -----------------------------------------------------------------------------

    @property
    def has_disk(self) -> bool:
        return self.disk_pages > 0

    @property
    def num_host_entries(self) -> int:
        return len(self._host)

    @property
    def num_free_slots(self) -> int:
        return self._slots.num_free

    @property
    def num_disk_entries(self) -> int:
        return len(self._disk)

    def host_state(self, key: bytes) -> str | None:
        entry = self._host.get(key)
        return None if entry is None else entry.state

    def on_disk(self, key: bytes) -> bool:
        return key in self._disk

    def host_run(self, keys: list[bytes], start: int, stop: int) -> list[int]:
        """Slots of ``keys[start:]`` up to ``stop`` (exclusive) while they are loadable from host
        memory (saving or ready), in order."""
        slots = []
        for key in keys[start:stop]:
            entry = self._host.get(key)
            if entry is None or entry.state == "fetching":
                break
            slots.append(entry.slot)
        return slots

    def held_run(self, keys: list[bytes], start: int, stop: int) -> int:
        """How many of ``keys[start:stop]`` in a row host memory (in any state) or disk holds."""
        host, disk = self._host, self._disk
        n = start
        while n < stop and (keys[n] in host or keys[n] in disk):
            n += 1
        return n - start

    def fetching_in(self, keys: list[bytes], start: int, stop: int) -> bool:
        """Whether a disk read is in flight for one of ``keys[start:stop]``."""
        return self.fetching_count(keys, start, stop) > 0

    def fetching_count(self, keys: list[bytes], start: int, stop: int) -> int:
        """Disk reads in flight for ``keys[start:stop]``."""
        if not self._num_fetching:
            return 0
        return sum(1 for k in keys[start:stop] if (e := self._host.get(k)) is not None and e.state == "fetching")

    def busy(self) -> bool:
        """Transfers to send, or acknowledgements to wait for."""
        return not self._out.empty() or bool(self._saving) or self._num_fetching > 0 or self._num_writing > 0

    def has_outgoing(self) -> bool:
        return not self._out.empty()

    # -- planning ----------------------------------------------------------------------------

    def save(self, keys: list[bytes], pages: list[int], known: int = 0) -> int:
        """Copy the pages whose key host memory lacks (``pages[i]`` holds ``keys[i]``); returns how
        many copies were queued. Keys present are marked recently used (the chain's tail least).
        ``known``: the first ``known`` keys are known to be in host memory (the caller saw them there
        since the last ``epoch`` change) and were marked used this step: neither looked up nor touched
        here (``touch`` them once later), still spared as the chain's own."""
        host = self._host
        missing = [i for i in range(known, len(keys)) if keys[i] not in host]
        slots = self._alloc(len(missing), chain=keys)     # the chain's own pages are not the victims
        self.counters.save_skipped += len(missing) - len(slots)
        for i, slot in zip(missing, slots):
            self._host[keys[i]] = HostEntry(slot, "saving")
            self._out.saves.append((pages[i], slot))
            self._out.save_keys.append(keys[i])
        self._touch(keys[known:] if known else keys)
        self.counters.saved += len(slots)
        return len(slots)

    def touch(self, keys: list[bytes]) -> None:
        """Mark ``keys`` (a chain, root first) used now, the first most recently."""
        self._touch(keys)

    def load(self, keys: list[bytes], pages: list[int], shift: int = 0, start_now: bool = False) -> None:
        """Promote ``keys`` (each loadable: ``host_run``) into device ``pages``; ``shift``: a
        position delta the worker rotates the loaded keys by (a truncated prompt's re-positioned KV);
        ``start_now``: no step in flight writes ``pages`` (the plan's loads start at once if all may)."""
        self._out.loads_start_now = self._out.loads_start_now and start_now
        for key, page in zip(keys, pages, strict=True):
            entry = self._host[key]
            if shift:
                self._out.shifted_loads.append((entry.slot, page, shift))
            else:
                self._out.loads.append((entry.slot, page))
            if entry.from_disk:
                self.counters.loaded_from_disk += 1
                self.counters.prefetch_used += 1
                entry.from_disk = False
        self.counters.loaded += len(keys)
        self.counters.loaded_at_once += len(keys) if start_now else 0
        self._touch(keys)

    def prefetch(self, keys: list[bytes], start: int, stop: int, spare: set[bytes] = frozenset()) -> int:
        """Read ``keys[start:stop]`` from disk into host memory where host memory lacks them, in
        order, stopping at the first key on neither tier; returns the reads queued (whether a run is
        worth reading is the caller's call: ``disk_run``)."""
        queued = 0
        chain = keys[start:stop]
        self._touch(chain)
        spare = set(chain) | spare   # never evict the chain's own pages to fetch its next ones
        for key in chain:
            if key in self._host:
                continue
            if key not in self._disk:
                break
            slots = self._alloc(1, spare)
            if not slots:
                break
            self._host[key] = HostEntry(slots[0], "fetching")
            self._out.disk_reads.append((key, slots[0]))
            self._disk.move_to_end(key)
            self._num_fetching += 1
            queued += 1
        return queued

    def disk_run(self, chain: list[bytes]) -> int:
        """Pages of ``chain`` a prefetch would read: on disk, not in host memory, before the first key on
        neither tier."""
        count = 0
        for key in chain:
            if key in self._host:
                continue
            if key not in self._disk:
                break
            count += 1
        return count

    @property
    def num_fetching(self) -> int:
        """Disk reads in flight."""
        return self._num_fetching

    def pin(self, keys: list[bytes]) -> None:
        """Keep ``keys``' host entries (a pinned prefix's pages, ``radixrelay.scheduler.pins``) out of
        eviction until ``unpin``; counted per pin."""
        for key in keys:
            self._pinned[key] = self._pinned.get(key, 0) + 1

    def unpin(self, keys: list[bytes]) -> None:
        for key in keys:
            left = self._pinned[key] - 1
            if left:
                self._pinned[key] = left
            else:
                del self._pinned[key]

    @property
    def num_pinned(self) -> int:
        """Keys pinned (their host entries, once saved, are not evicted)."""
        return len(self._pinned)

    def protect(self, keys: set[bytes]) -> None:
        """Keys of the waiting queue's look-ahead window: the ``scheduler`` policy never evicts them."""
        self._protected = keys

    def take(self, step_id: int) -> KVTransfers | None:
        """The transfers to send with plan ``step_id`` (None when there are none)."""
        out = self._out
        if out.empty():
            return None
        if out.saves:
            self._saving[step_id] = out.save_keys
        self._out = _Outbox()
        return KVTransfers(out.saves, out.loads, out.disk_writes, out.disk_reads, out.disk_deletes,
                           out.shifted_loads, bool(out.loads or out.shifted_loads) and out.loads_start_now)

    def on_acks(self, acks: KVAcks) -> list[int]:
        """Apply the worker's acknowledgements; returns the steps whose saves completed or failed
        (the caller unlocks what it locked for them)."""
        done = []
        for step in acks.saved_steps:
            for key in self._saving.pop(step, []):
                entry = self._host.get(key)
                if entry is not None and entry.state == "saving":
                    entry.state = "ready"
                    self._changed("host", True, key)
                    self._queue_write(key, entry)
            done.append(step)
        for step in acks.failed_steps:
            for key in self._saving.pop(step, []):
                self._drop(key)
            done.append(step)
        for key in acks.written:
            self._end_write(key)
            if key not in self._disk:
                self._disk[key] = None
                self._changed("disk", True, key)
                self.counters.written += 1
                self._trim_disk()
        for key in acks.write_failed:
            self._end_write(key)
        for key in acks.read:
            entry = self._host.get(key)
            if entry is not None and entry.state == "fetching":
                entry.state, entry.from_disk = "ready", True
                self._changed("host", True, key)
                self._num_fetching -= 1
                self.counters.read += 1
        for key in acks.read_failed:
            entry = self._host.get(key)
            if entry is not None and entry.state == "fetching":
                self._num_fetching -= 1
                self._drop(key)
            if key in self._disk:
                del self._disk[key]
                self._changed("disk", False, key)
            self.counters.read_failed += 1
        self.counters.load_s += acks.load_s
        self.counters.load_exposed_s += acks.load_exposed_s
        self.counters.save_s += acks.save_s
        return done

    # -- integrity ---------------------------------------------------------------------------

    def check_integrity(self) -> None:
        self._slots.check_integrity()
        slots = [e.slot for e in self._host.values()]
        if len(set(slots)) != len(slots) or len(slots) + self._slots.num_free != self.host_pages:
            raise AssertionError("KVTiers: host slots are lost or held twice")
        if len(self._disk) > self.disk_pages:
            raise AssertionError("KVTiers: disk over capacity")
        if self._num_fetching != sum(e.state == "fetching" for e in self._host.values()):
            raise AssertionError("KVTiers: fetching count is stale")
        if self._num_writing != sum(e.writing for e in self._host.values()):
            raise AssertionError("KVTiers: writing count is stale")
        saving = {k for keys in self._saving.values() for k in keys} | set(self._out.save_keys)
        if any(e.state == "saving" and k not in saving for k, e in self._host.items()):
            raise AssertionError("KVTiers: a saving slot belongs to no step")

    # -- internals ---------------------------------------------------------------------------

    def _touch(self, keys: list[bytes]) -> None:
        """Mark ``keys`` (a chain, root first) used now, the first most recently: evicting from the
        LRU end then takes a chain's tail before its head (a head alone still serves a prefix)."""
        host, disk = self._host, self._disk
        self.moves += len(keys)
        for key in reversed(keys):
            if key in host:
                host.move_to_end(key)
            if disk and key in disk:
                disk.move_to_end(key)

    def _alloc(self, n: int, spare: set[bytes] = frozenset(), chain: list[bytes] = ()) -> list[int]:
        """Up to ``n`` free host slots, evicting LRU entries that are neither in flight, nor in
        ``spare`` or ``chain``, nor pinned, nor (policy ``scheduler``) protected.

        A save whose slots are consecutive moves as one block per layer (``TierStore``), and a piece
        costs the worker a copy per layer and K/V: so once host memory is full, eviction goes on past
        the shortage (up to ``n`` more LRU entries, which the next saves would evict anyway) until one
        free run holds all ``n``. Evicting exactly the shortage would free runs out of phase with the
        saves (the tail of one old chain, the head of the next) and split every later save in two."""
        if n <= 0:
            return []
        slots = self._slots
        if n > slots.num_free:
            if chain:
                spare = spare | set(chain)
            victims = []
            budget = n - slots.num_free + n
            for key, entry in self._host.items():
                if len(victims) == budget:
                    break
                if entry.state != "ready" or entry.writing:
                    continue
                if key in spare or key in self._pinned or (self.policy == "scheduler" and key in self._protected):
                    continue
                victims.append(key)
            evicted = 0
            for key in victims:
                if slots.num_free >= n and slots.longest_run >= n:
                    break
                self._drop(key)
                evicted += 1
            self.counters.host_evicted += evicted
        return slots.alloc(min(n, slots.num_free), one_run=True) or []

    def take_dropped(self) -> list[bytes] | None:
        """The keys that left host memory since the last call, oldest first; None when more than
        ``MAX_DROPPED`` did (then anything may have left)."""
        dropped, self._dropped = self._dropped, []
        return dropped

    def _drop(self, key: bytes) -> None:
        entry = self._host.pop(key, None)
        if entry is not None:
            self.epoch += 1
            if entry.state == "ready":
                self._changed("host", False, key)
            if self._dropped is not None:
                self._dropped.append(key)
                if len(self._dropped) > MAX_DROPPED:
                    self._dropped = None
            if entry.writing:
                self._num_writing -= 1
            self._slots.free([entry.slot])

    def _queue_write(self, key: bytes, entry: HostEntry) -> None:
        if self.has_disk and key not in self._disk and not entry.writing:
            entry.writing = True
            self._num_writing += 1
            self._out.disk_writes.append((entry.slot, key))

    def _end_write(self, key: bytes) -> None:
        entry = self._host.get(key)
        if entry is not None and entry.writing:
            entry.writing = False
            self._num_writing -= 1

    def _trim_disk(self) -> None:
        while len(self._disk) > self.disk_pages:
            key, _ = self._disk.popitem(last=False)
            self._changed("disk", False, key)
            self._out.disk_deletes.append(key)
            self.counters.disk_evicted += 1
