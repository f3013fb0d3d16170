"""Worker side of the lower KV tiers: the host-memory pool, the disk store, and the copies between
them and the device KV cache (``radixrelay.protocol.kv.KVTransfers``, planned by ``radixrelay.radix.tiers``).

Host pool: ``host: [num_layers, 2 (K, V), host_pages * page_size, num_kv_heads, head_dim]``, laid out
like the device cache, so a run of pages consecutive on both sides moves as one 2-D copy over the
(layer, K/V) planes (``plane_copy``: the copy engines' work, no gather kernels, one launch); pinned on
CUDA. A disk file holds one page's
``[num_layers, 2, page_size, num_kv_heads, head_dim]``, gathered / scattered on the I/O thread.

Ordering (what the scheduler relies on, ``KVTransfers``):
- on CUDA saves run on one copy stream and loads on another, each after everything the compute stream
  was given before (an event): a save reads KV that earlier steps wrote; a load may fill pages that a step still
  in flight last used. A plan's saves are launched after its forward (``TierStore.apply``), so their
  host work overlaps the device's. The step's forward waits for the loads (``load_exposed_s``); saves run while
  later steps compute (the scheduler keeps their pages locked until acknowledged);
- disk reads and writes run on a pool of ``DISK_THREADS`` I/O threads (``DiskIO``: a page's jobs in plan
  order, reads before writes), each handed over only once the copies queued before it are done (so a
  slot is never read for disk while its save is in flight, nor overwritten while a load from it is); their
  results are acknowledged in plan order; a disk job running past ``DISK_DEADLINE_S`` is given up: a read
  becomes a miss, a write a failed write, and a fresh thread takes its thread's place, so a stuck file
  system never stalls admission or the worker;
- on the CPU everything runs synchronously in plan order.

Shifted loads (``KVTransfers.shifted_loads``, a truncated prompt's re-positioned KV): after layer l's
copies, the keys of those pages are rotated by their position delta on the same stream, in float32
(RoPE of position p rotated by d is RoPE of position p + d), before layer l counts as loaded.
"""

from __future__ import annotations

import errno
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from radixrelay.attention import KVCache
from radixrelay.kernels.host_staging import upload
from radixrelay.model.layers import apply_rope
from radixrelay.protocol.kv import KVAcks, KVTransfers
from radixrelay.radix.disk_store import DiskKVStore, disk_tier_gib, rank_namespace
from radixrelay.worker.host_memory import pinned_empty, release
from radixrelay.worker.plane_copy import copy_planes

logger = logging.getLogger("radixrelay.worker")

# Device memory for the pages a save gathers at a time, every layer (64 pages at Llama-3-8B shapes, bf16,
# pages of 16 tokens: 2 MiB a page), and at most STAGE_MAX_PAGES pages.
STAGE_BYTES = 128 << 20
STAGE_MAX_PAGES = 512
# Loads complete in groups of this many layers (one event each; a step's layer l waits for its group):
# a run of pages is one 2-D copy per group (``plane_copy``), so fewer groups are fewer launches.
LOAD_LAYERS_PER_EVENT = 4
# Device memory a load stages a layer group's scattered pages in (``_load_plan``): 256 pages of one group
# at Llama-3-8B shapes (bf16, pages of 16 tokens, 64 KiB a page and layer), a 4K-token history.
LOAD_STAGE_BYTES = 64 << 20
# Seconds a disk job (one page read, write or delete) may run before it is given up. A page is a few
# MiB: a working disk moves it in milliseconds, so a job this slow is on storage that hangs.
DISK_DEADLINE_S = 5.0
# Threads moving pages between host memory and disk: reads and checksums of different pages overlap
# (file reads, zlib.crc32 and the copies into host slots release the GIL).
DISK_THREADS = 8
# After a write finds the disk full, writes fail at once for this long (serving goes on; reads go on).
DISK_FULL_PAUSE_S = 30.0


@dataclass
class DiskStats:
    """The disk tier's work on the worker, cumulative (``WorkerCounters`` reports it)."""
    read_s: float = 0.0           # seconds the I/O threads spent reading pages (summed over threads)
    write_s: float = 0.0          # ... writing pages
    full_writes: int = 0          # writes refused or failed because the disk (or quota) was full
    given_up: int = 0             # jobs past their deadline (``DiskIO.abandoned``)


def page_bytes(kv: KVCache) -> int:
    k = kv.k[0]
    return 2 * kv.num_layers * kv.page_size * k.shape[1] * k.shape[2] * k.element_size()


class TierStore:
    def __init__(self, kv: KVCache, host_pages: int, disk: DiskKVStore | None = None,
                 disk_deadline_s: float = DISK_DEADLINE_S) -> None:
        if host_pages < 1:
            raise ValueError(f"TierStore: host_pages must be >= 1, got {host_pages}")
        self.kv = kv
        self.disk = disk
        k = kv.k[0]
        self._cuda = kv.device.type == "cuda"
        shape = (kv.num_layers, 2, host_pages * kv.page_size, k.shape[1], k.shape[2])
        # pinned on CUDA (non-blocking copies): mapped and registered in seconds (``host_memory``)
        self.host = pinned_empty(shape, kv.dtype) if self._cuda else torch.empty(shape, dtype=kv.dtype)
        self._host_planes = self.host.view((-1,) + shape[2:])       # [num_layers * 2, slots * page_size, Hkv, D]
        self.page_bytes = page_bytes(kv)
        # CUDA: saves and loads on two copy streams (a load never queues behind a large save);
        # a copy touching a host slot waits for the last copy on the other stream that touched it.
        self._save_stream = torch.cuda.Stream(kv.device) if self._cuda else None
        self._load_stream = torch.cuda.Stream(kv.device) if self._cuda else None
        self._slot_events: dict[int, torch.cuda.Event] = {}
        self._saves: deque[tuple[int, object, object]] = deque()  # (step id, start, done events) in order
        self._loads: deque[tuple[object, object, object]] = deque()  # (step start, load start, done)
        self._io = DiskIO(disk_deadline_s) if disk is not None else None
        self.disk_stats = DiskStats()
        self._stats_lock = threading.Lock()
        self._full_until = 0.0                              # monotonic time until which writes are refused
        self._io_jobs: deque[DiskJob] = deque()           # on the I/O thread, in plan order
        self._io_fenced: deque[tuple[tuple, list]] = deque()  # (fence events, jobs) not yet handed over
        self._failed: list[int] = []
        self._deferred: tuple[int, list[tuple[int, int]], object] | None = None   # (step, saves, after)
        self._cpu_load_s = self._cpu_exposed_s = self._cpu_save_s = 0.0
        # positions int [T] -> (cos, sin) [T, D] (the model's ``RotaryEmbedding``): shifted loads
        self.rotary = None
        # flat, room for ``_stage_pages`` pages [num_layers, 2, pages * page_size, Hkv, D]: scattered saves
        # (``_gather_out``); on CUDA taken at start-up, beside the KV cache, not on the first save
        self._stage_pages = max(1, min(STAGE_MAX_PAGES, STAGE_BYTES // self.page_bytes))
        self._stage: torch.Tensor | None = self._stage_buffer() if self._cuda else None
        # flat, room for ``_load_stage_pages`` pages of one layer group [group, 2, pages * page_size, Hkv, D]:
        # loads into scattered pages (``_scatter_in``); reused in load-stream order
        group_page_bytes = self.page_bytes // kv.num_layers * min(LOAD_LAYERS_PER_EVENT, kv.num_layers)
        self._load_stage_pages = max(1, LOAD_STAGE_BYTES // group_page_bytes)
        self._load_stage: torch.Tensor | None = self._load_stage_buffer() if self._cuda else None

    # -- applying a plan's transfers -------------------------------------------------------------

    def apply(self, step_id: int, t: KVTransfers) -> None:
        """Queue ``t`` (before the step's forward). A failed save is reported in ``KVAcks.failed_steps``.
        Loads are layer-wise on CUDA: layer l's attention waits only for layer l's pages
        (``KVCache.wait_for_layer``), so loading later layers overlaps computing earlier ones.

        Saves are only recorded here and queued by ``after_forward`` (or the next ``apply`` or
        ``acks``), so that their launches (a gather and a copy per slot run, layer and K/V) happen while
        the device computes, not before the step's kernels. They read pages earlier steps wrote (the
        event taken now) and that this step's forward does not touch (the scheduler keeps them locked),
        so the later launch changes nothing they copy; a plan that loads from a slot it also saves
        queues its saves first, as before."""
        self._flush_saves()
        after = self._after_compute()
        loads = t.loads + [(slot, page) for slot, page, _ in t.shifted_loads]
        if t.saves:
            self._deferred = (step_id, t.saves, after)
            if loads and {slot for _, slot in t.saves} & {slot for slot, _ in loads}:
                self._flush_saves()
        if loads:
            begun = time.perf_counter()
            # pages no step in flight writes (``loads_start_now``): the copies start beside those steps
            events = self._copy(loads, save=False, after=None if t.loads_start_now else after,
                                shifts=t.shifted_loads)
            if self._cuda:
                self.kv.layer_ready = events[1:]
                self._loads.append((after, events[0], events[-1]))
            else:                               # synchronous: the step waits for all of it
                took = time.perf_counter() - begun
                self._cpu_load_s += took
                self._cpu_exposed_s += took
        if self._io is not None and (t.disk_writes or t.disk_reads or t.disk_deletes):
            fence = (self._record(self._save_stream), self._record(self._load_stream))
            # deletes first: a key trimmed from disk and saved again in one plan must end up on disk
            jobs = [(self._delete, "delete", key, ()) for key in t.disk_deletes]
            jobs += [(self._write, "write", key, (slot,)) for slot, key in t.disk_writes]
            jobs += [(self._read, "read", key, (slot,)) for key, slot in t.disk_reads]
            self._io_fenced.append((fence, jobs))
            self._pump_io(wait=False)

    def _pump_io(self, wait: bool) -> None:
        """Hand disk jobs to the I/O thread once the copies queued before them are done. CUDA is
        only ever touched here, on the worker's thread: the I/O thread never queries or waits for
        events (not permitted while the worker captures a CUDA graph)."""
        while self._io_fenced and (wait or all(_done(e) for e in self._io_fenced[0][0])):
            fence, jobs = self._io_fenced.popleft()
            _sync(fence)
            self._io_jobs.extend(self._io.submit(fn, kind, key, *args) for fn, kind, key, args in jobs)

    def _flush_saves(self) -> None:
        """Queue the saves ``apply`` recorded (see there)."""
        if self._deferred is None:
            return
        step_id, saves, after = self._deferred
        self._deferred = None
        try:
            begun = time.perf_counter()
            events = self._copy(saves, save=True, after=after)
            if not self._cuda:
                self._cpu_save_s += time.perf_counter() - begun
            self._saves.append((step_id, events[0], events[-1]))
        except Exception:  # noqa: BLE001 - the slots hold nothing; the scheduler drops them
            logger.exception("KV save of step %d failed", step_id)
            self._failed.append(step_id)

    def after_forward(self, rows: bool = True) -> None:
        """After the step's forward was queued: its saves are queued now. ``rows`` False (a plan of
        transfers alone): its loads stay in ``KVCache.layer_ready`` for the next step with rows, whose
        layer l waits for layer l of them (a later plan's own loads replace them: one load stream, so
        its layer l completes after every layer of these). Else a forward that did not wait for every
        layer (an error, a path without attention hooks) makes the compute stream wait for all loads."""
        self._flush_saves()
        if rows:
            self.wait_for_loads()

    def wait_for_loads(self) -> None:
        """Order everything queued next on the compute stream after every load queued so far (a step
        that cannot wait layer by layer: a decode step's CUDA graph)."""
        events = self.kv.layer_ready
        if events:
            torch.cuda.current_stream(self.kv.device).wait_event(events[-1])
        self.kv.layer_ready = None

    def acks(self, wait: bool) -> KVAcks | None:
        """Transfers completed since the last call; ``wait``: block until all queued ones are."""
        self._flush_saves()
        saved = []
        save_s, self._cpu_save_s = self._cpu_save_s, 0.0
        while self._saves and (wait or _done(self._saves[0][2])):
            step, start, done = self._saves.popleft()
            _sync(done)
            saved.append(step)
            if start is not None:
                save_s += start.elapsed_time(done) / 1e3
        load_s, self._cpu_load_s = self._cpu_load_s, 0.0
        exposed, self._cpu_exposed_s = self._cpu_exposed_s, 0.0
        while self._loads and (wait or _done(self._loads[0][2])):
            step_start, start, done = self._loads.popleft()
            _sync(done)
            load_s += start.elapsed_time(done) / 1e3
            # a load that started at once may finish before its step could start (the steps queued
            # before still compute): then nothing of it was exposed, and the step's start event is not
            # yet complete, which elapsed_time refuses
            if _done(step_start):
                exposed += max(0.0, step_start.elapsed_time(done) / 1e3)
        written, write_failed, read, read_failed = [], [], [], []
        if self._io is not None:
            self._pump_io(wait)
        while self._io_jobs and self._io.settle(self._io_jobs[0], wait):
            kind, key, ok = self._io_jobs.popleft().result
            if kind == "write":
                (written if ok else write_failed).append(key)
            elif kind == "read":
                (read if ok else read_failed).append(key)
        failed, self._failed = self._failed, []
        if not (saved or failed or written or write_failed or read or read_failed or load_s or save_s):
            return None
        # exposed: how far loads ran past the point their step could start (an upper bound of the
        # wait: layer-wise loading overlaps part of it with the step's first layers).
        return KVAcks(saved, failed, written, write_failed, read, read_failed, load_s, exposed, save_s)

    def settled(self) -> bool:
        """Whether every transfer queued so far has completed (``acks(wait=True)`` would not block); never
        waits."""
        self._flush_saves()
        if not all(_done(e[2]) for e in self._saves) or not all(_done(e[2]) for e in self._loads):
            return False
        if self._io is None:
            return True
        self._pump_io(wait=False)
        return not self._io_fenced and all(job.finished.is_set() for job in self._io_jobs)

    def close(self) -> None:
        if self._io is not None:
            self._io.close(self._io_jobs)
        if self._cuda:
            torch.cuda.synchronize(self.kv.device)       # no copy may still read or write the pool
            release(self.host)

    # -- copies ---------------------------------------------------------------------------------

    def _copy(self, pairs: list[tuple[int, int]], *, save: bool, after,
              shifts: list[tuple[int, int, int]] = ()) -> list:
        """Saves: (device page, host slot) pairs; loads: (host slot, device page) pairs. Saves: one 2-D copy
        per run consecutive on both sides, scattered pages gathered (``_save_runs``). Loads: per group of
        ``LOAD_LAYERS_PER_EVENT`` layers, one 2-D copy per such run, scattered pages staged and scattered
        (``_load_plan``). On CUDA the copy engines move the KV, and a load's launches grow with its runs
        of host slots, not with how fragmented the device pool is.
        ``after``: an event on the compute stream the copies wait for (None: they start at once).
        Returns CUDA events: for a save [start, done]; for a load [start, layer 0 done, ..., layer L-1 done]
        (CPU: [None])."""
        if save:
            pairs = [(slot, page) for page, slot in pairs]
        if not self._cuda:
            if save:
                self._save_runs(pairs)
            else:
                self._load(pairs, shifts)
            return [None]
        stream = self._save_stream if save else self._load_stream
        slots = {slot for slot, _ in pairs}
        with torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            # copies still in flight on these slots (a save into one, a load out of one): each event once
            earlier = {id(e): e for e in map(self._slot_events.get, slots) if e is not None}
            for event in earlier.values():
                if not event.query():
                    stream.wait_event(event)
            events = [self._record(stream, timing=True)]
            if save:
                self._save_runs(pairs)
                events.append(self._record(stream, timing=True))
            else:
                events += self._load(pairs, shifts)
            done = events[-1]
            for slot in slots:
                self._slot_events[slot] = done
        return events

    def _load(self, pairs: list[tuple[int, int]], shifts) -> list:
        """Loads of (host slot, device page) pairs, group of layers by group (``_load_plan``), each group's
        shifted keys rotated after its copies. Returns an event per layer, its group's (CUDA; else [])."""
        direct, staged = self._load_plan(pairs)
        rotations = self._rotations(shifts)
        num_layers, events = self.kv.num_layers, []
        for first in range(0, num_layers, LOAD_LAYERS_PER_EVENT):
            layers = range(first, min(first + LOAD_LAYERS_PER_EVENT, num_layers))
            for slots, pages in direct:
                self._copy_run(layers, slots, pages, save=False)
            for pieces, rows in staged:
                self._scatter_in(layers, pieces, rows)
            for layer in layers:
                self._rotate(layer, rotations)
            if self._cuda:
                events += [self._record(self._load_stream, timing=True)] * len(layers)
        return events

    def _load_plan(self, pairs: list[tuple[int, int]]):
        """(host slot, device page) pairs -> (direct, staged). ``direct``: (slots, pages) ranges consecutive on
        both sides, one 2-D copy each. ``staged``: the runs of consecutive slots whose pages lie in more than
        two runs (the pages of a history evicted and loaded into a fragmented pool), in chunks of at most
        ``_load_stage_pages`` pages: (pieces, device rows), pieces (first host slot, page count) in stage
        order, rows int64 [pages * page_size] on the device, the pool rows the stage's rows go to."""
        direct: list[tuple[range, range]] = []
        scattered: list[tuple[int, list[int]]] = []        # (first slot, device pages), slot runs
        for slots, pages in _slot_runs(pairs):
            runs = list(_runs(list(zip(slots, pages))))
            if len(runs) <= 2:                  # as cheap as staging: copy straight in
                direct += runs
            else:
                scattered.append((slots.start, pages))
        staged = [([(first, len(run)) for first, run in c], self._page_rows([p for _, run in c for p in run]))
                  for c in _chunks(scattered, self._load_stage_pages)]
        return direct, staged

    def _page_rows(self, pages: list[int]) -> torch.Tensor:
        """The pool rows of ``pages`` in order, int64 [len(pages) * page_size], on the device."""
        ps = self.kv.page_size
        rows = (np.asarray(pages, dtype=np.int64)[:, None] * ps + np.arange(ps, dtype=np.int64)).reshape(-1)
        return upload(rows, torch.int64, self.kv.device) if self._cuda else torch.from_numpy(rows)

    def _scatter_in(self, layers: range, pieces: list[tuple[int, int]], rows: torch.Tensor) -> None:
        """One staged chunk of a load, K and V of ``layers``: a 2-D copy per piece (first host slot, pages)
        into the load staging buffer, then one scatter of its rows into the pool's ``rows``."""
        kv, ps = self.kv, self.kv.page_size
        if self._load_stage is None:
            self._load_stage = self._load_stage_buffer()
        n = rows.numel()
        shape = (len(layers), 2, n) + tuple(kv.buffer.shape[3:])
        stage = self._load_stage[:math.prod(shape)].view(shape)
        planes = stage.view((-1,) + stage.shape[2:])                     # [len(layers) * 2, n, Hkv, D]
        host = self.host[layers.start:layers.stop].flatten(0, 1)
        at = 0
        for first, count in pieces:
            self._copy_planes(planes[:, at:at + count * ps], host[:, first * ps:(first + count) * ps])
            at += count * ps
        dest = kv.buffer[layers.start:layers.stop]
        if kv.buffer.element_size() == 1:                 # an FP8 cache: scattered as bytes
            dest, stage = dest.view(torch.uint8), stage.view(torch.uint8)
        dest.index_copy_(2, rows, stage)

    def _load_stage_buffer(self) -> torch.Tensor:
        """Flat staging memory for ``_load_stage_pages`` pages of one layer group."""
        group = min(LOAD_LAYERS_PER_EVENT, self.kv.num_layers)
        per_page = self.page_bytes // self.kv.num_layers * group // self.kv.buffer.element_size()
        return torch.empty(self._load_stage_pages * per_page, dtype=self.kv.dtype, device=self.kv.device)

    def _save_runs(self, pairs: list[tuple[int, int]]) -> None:
        """Saves of (host slot, device page) pairs. Pages consecutive on both sides move as plain copies
        (``_copy_run``). Runs of consecutive host slots whose device pages are scattered (a request's
        decode pages, allocated one at a time) are gathered on the device, every layer at once, into the
        staging buffer, up to ``_stage_pages`` pages at a time, then copied out as one block per (slot
        run, layer, K/V).

        One gather kernel per chunk, not one per layer: on a busy device a kernel on this stream waits
        for a gap between the forward's kernels, and the copies behind it wait for the kernel, so a
        save of L layers gathered one by one trickles out over many forwards (the stream falls behind,
        its queue fills, and then every launch on the worker's thread blocks). The staging buffer is
        reused in stream order (each gather follows the copies out of the one before it)."""
        gathered: list[tuple[int, list[int]]] = []          # (first slot, device pages), slot runs
        for slots, pages in _slot_runs(pairs):
            direct = list(_runs(list(zip(slots, pages))))
            if len(direct) <= 2:                # as cheap as a gather: copy straight out
                for run_slots, run_pages in direct:
                    self._copy_run(range(self.kv.num_layers), run_slots, run_pages, True)
            else:
                gathered.append((slots.start, pages))
        for chunk in _chunks(gathered, self._stage_pages):
            self._gather_out(chunk)

    def _gather_out(self, pieces: list[tuple[int, list[int]]]) -> None:
        """``pieces``: (first host slot, device pages) runs of consecutive slots, ``_stage_pages`` pages
        at most in all. One gather of their pages, every layer and K/V, then a copy per (piece, layer,
        K/V) out to host memory."""
        kv, ps = self.kv, self.kv.page_size
        pages = [p for _, run in pieces for p in run]
        n = len(pages) * ps
        rows = self._page_rows(pages)
        if self._stage is None:
            self._stage = self._stage_buffer()
        shape = (kv.num_layers, 2, n) + tuple(kv.buffer.shape[3:])
        stage = self._stage[:math.prod(shape)].view(shape)       # contiguous: the staging buffer's first part
        if kv.buffer.element_size() == 1:                 # an FP8 cache: gathered as bytes
            torch.index_select(kv.buffer.view(torch.uint8), 2, rows, out=stage.view(torch.uint8))
        else:
            torch.index_select(kv.buffer, 2, rows, out=stage)
        planes = stage.view((-1,) + stage.shape[2:])                     # [num_layers * 2, n, Hkv, D]
        at = 0
        for first, run in pieces:
            host_rows = slice(first * ps, (first + len(run)) * ps)
            self._copy_planes(self._host_planes[:, host_rows], planes[:, at:at + len(run) * ps])
            at += len(run) * ps

    def _stage_buffer(self) -> torch.Tensor:
        """Flat staging memory for ``_stage_pages`` pages of every layer."""
        return torch.empty(self._stage_pages * self.page_bytes // self.kv.buffer.element_size(),
                           dtype=self.kv.dtype, device=self.kv.device)

    def _copy_run(self, layers: range, slots: range, pages: range, save: bool) -> None:
        """Host slots ``slots`` <-> device pages ``pages`` (as many, both consecutive), K and V of ``layers``."""
        ps = self.kv.page_size
        host_rows = slice(slots.start * ps, slots.stop * ps)
        dev_rows = slice(pages.start * ps, pages.stop * ps)
        # [len(layers) * 2, n * ps, Hkv, D]: planes at the pitch of either allocation
        host = self.host[layers.start:layers.stop, :, host_rows].flatten(0, 1)
        dev = self.kv.buffer[layers.start:layers.stop, :, dev_rows].flatten(0, 1)
        if save:
            self._copy_planes(host, dev)
        else:
            self._copy_planes(dev, host)

    def _copy_planes(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """[P, rows, Hkv, D] planes: one 2-D copy on CUDA (``plane_copy``: a launch per plane would bound
        a load by the worker's launch rate), else (or without the runtime's entry point) plane by plane."""
        if self._cuda and copy_planes(dst, src, torch.cuda.current_stream(self.kv.device)):
            return
        for d, s in zip(dst.unbind(0), src.unbind(0)):
            d.copy_(s, non_blocking=self._cuda)

    def _rotations(self, shifts) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per position delta: (device rows [R], cos [R, D], sin [R, D]) for ``_rotate``."""
        if not shifts:
            return []
        if self.rotary is None:
            raise ValueError("shifted KV loads need the model's rotary embedding (TierStore.rotary), and one that "
                             "rotates by the position delta (not LongRoPE's)")
        ps, device = self.kv.page_size, self.kv.device
        by_delta: dict[int, list[int]] = {}
        for _, page, delta in shifts:
            by_delta.setdefault(delta, []).append(page)
        out = []
        for delta, pages in by_delta.items():
            rows = (torch.tensor(pages, dtype=torch.int64)[:, None] * ps + torch.arange(ps)).flatten()
            rows = rows.to(device, non_blocking=True)
            cos, sin = self.rotary(torch.full((1,), delta, dtype=torch.int64, device=device))
            out.append((rows, cos.expand(rows.numel(), -1), sin.expand(rows.numel(), -1)))
        return out

    def _rotate(self, layer: int, rotations) -> None:
        """Rotate the keys of layer ``layer``'s shifted rows by their delta (float32, in place)."""
        k = self.kv.k[layer]
        for rows, cos, sin in rotations:
            k[rows] = apply_rope(k[rows].float(), cos, sin).to(k.dtype)

    def _after_compute(self):
        """A timing event after everything queued on the compute stream so far (None on the CPU)."""
        if not self._cuda:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.kv.device))
        return event

    @staticmethod
    def _record(stream, timing: bool = False):
        if stream is None:
            return None
        event = torch.cuda.Event(enable_timing=timing)
        event.record(stream)
        return event

    # -- disk (on the I/O thread) ----------------------------------------------------------------

    def _slot(self, slot: int) -> torch.Tensor:
        """Host slot ``slot`` as a strided view ``[num_layers, 2, page_size, Hkv, D]``."""
        ps = self.kv.page_size
        return self.host[:, :, slot * ps:(slot + 1) * ps]

    def _write(self, job: DiskJob, key: bytes, slot: int) -> tuple[str, bytes, bool]:
        begun = time.monotonic()
        if begun < self._full_until:          # the disk was full a moment ago: not even tried
            self._count(full_writes=1)
            return "write", key, False
        try:
            page = self._slot(slot).contiguous()
            self.disk.write(key, page.view(torch.uint8).reshape(-1).numpy())
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                logger.exception("KV page write to disk failed")
                return "write", key, False
            with self._stats_lock:
                first = begun >= self._full_until
                self._full_until = time.monotonic() + DISK_FULL_PAUSE_S
                self.disk_stats.full_writes += 1
            if first:
                logger.warning("disk KV tier: the disk is full (%s); page writes pause for %.0f s, reads and "
                               "serving go on", exc.strerror, DISK_FULL_PAUSE_S)
            return "write", key, False
        finally:
            self._count(write_s=time.monotonic() - begun)
        if not self._io.commit(job):          # given up and reported failed: not on disk
            self._delete(job, key)
            return "write", key, False
        return "write", key, True

    def _read(self, job: DiskJob, key: bytes, slot: int) -> tuple[str, bytes, bool]:
        begun = time.monotonic()
        view = self._slot(slot)
        page = torch.empty(view.shape, dtype=view.dtype)
        try:
            # a read given up is a miss, and its slot may already hold another page: never copy into it then
            if not self.disk.read_into(key, page.view(torch.uint8).reshape(-1).numpy()) or not self._io.commit(job):
                return "read", key, False
            view.copy_(page)
            return "read", key, True
        finally:
            self._count(read_s=time.monotonic() - begun)

    def _count(self, read_s: float = 0.0, write_s: float = 0.0, full_writes: int = 0) -> None:
        with self._stats_lock:
            s = self.disk_stats
            s.read_s += read_s
            s.write_s += write_s
            s.full_writes += full_writes

    def stats(self) -> DiskStats:
        """A copy of the disk tier's counters."""
        with self._stats_lock:
            given_up = self._io.abandoned if self._io is not None else 0
            return DiskStats(self.disk_stats.read_s, self.disk_stats.write_s, self.disk_stats.full_writes, given_up)

    def _delete(self, job: DiskJob, key: bytes) -> tuple[str, bytes, bool]:
        try:
            self.disk.delete(key)
        except OSError:
            logger.exception("KV page delete on disk failed")
        return "delete", key, True


class DiskJob:
    """A disk job for ``DiskIO``: ``fn(job, key, *args)`` -> (kind, key, ok)."""

    __slots__ = ("fn", "kind", "key", "args", "started", "committed", "abandoned", "result", "finished")

    def __init__(self, fn, kind: str, key: bytes, args: tuple) -> None:
        self.fn, self.kind, self.key, self.args = fn, kind, key, args
        self.started: float | None = None       # time.monotonic() when a thread took it
        self.committed = False
        self.abandoned = False
        self.result: tuple[str, bytes, bool] | None = None
        self.finished = threading.Event()       # set once ``result`` is final


class DiskIO:
    """Disk jobs on a pool of ``threads`` daemon threads, each job within a deadline.

    Invariants:
    - jobs of one key run one at a time, in submission order (a page's write, delete and read never
      overtake each other); jobs of different keys run in parallel;
    - of the jobs a thread may take, reads go first (a request may be waiting for them), then the
      others in submission order: a backlog of writes never delays a hit;
    - a job that has run ``deadline_s`` seconds without committing is given up by ``settle``: its result
      is (kind, key, False) and a fresh thread replaces the one running it, which, if its job ever
      returns, drops that job's result and exits; the key's later jobs then run (a given-up write may
      still land: the page file is then whole and content-addressed, or absent);
    - a job calls ``commit`` before it changes anything the worker or scheduler rely on (a host slot,
      a page file reported written): a given-up job never commits, a committed job is never given up.
    """

    def __init__(self, deadline_s: float, threads: int = DISK_THREADS) -> None:
        if deadline_s <= 0:
            raise ValueError(f"DiskIO: deadline_s must be > 0, got {deadline_s}")
        if threads < 1:
            raise ValueError(f"DiskIO: threads must be >= 1, got {threads}")
        self.deadline_s = deadline_s
        self.abandoned = 0                       # jobs given up so far
        self._cv = threading.Condition()
        self._pending: list[DiskJob] = []        # submitted, not yet taken, in submission order
        self._running: set[bytes] = set()        # keys of the jobs running (not finished, not given up)
        self._closing = False
        self._started = 0
        self._threads: list[threading.Thread] = []
        with self._cv:
            for _ in range(threads):
                self._start()

    def _start(self) -> None:
        """Start one more pool thread (``self._cv`` held)."""
        self._started += 1
        thread = threading.Thread(target=self._run, name=f"kv-disk-{self._started}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def submit(self, fn, kind: str, key: bytes, *args) -> DiskJob:
        job = DiskJob(fn, kind, key, args)
        with self._cv:
            self._pending.append(job)
            self._cv.notify()
        return job

    def _take(self) -> DiskJob | None:
        """The next job a thread may run (``self._cv`` held): the first read whose key has no earlier job
        unfinished, else the first such job of any kind."""
        ahead = set(self._running)           # keys with a job running or pending before this one
        first = None
        for i, job in enumerate(self._pending):
            if job.key not in ahead:
                if job.kind == "read":
                    first = i
                    break
                if first is None:
                    first = i
            ahead.add(job.key)
        if first is None:
            return None
        job = self._pending.pop(first)
        self._running.add(job.key)
        return job

    def _run(self) -> None:
        while True:
            with self._cv:
                job = None
                while not self._closing or self._pending:
                    job = self._take()
                    if job is not None:
                        break
                    self._cv.wait()
                if job is None:
                    return
                job.started = time.monotonic()
            try:
                result = job.fn(job, job.key, *job.args)
            except Exception:  # noqa: BLE001 - a failed job is a failure result, never a dead thread
                logger.exception("KV page %s on disk failed", job.kind)
                result = (job.kind, job.key, False)
            with self._cv:
                if job.abandoned:
                    return                       # given up: a fresh thread took this one's place
                job.result = result
                job.finished.set()
                self._done(job.key)

    def _done(self, key: bytes) -> None:
        """The running job of ``key`` finished or was given up (``self._cv`` held): its later jobs may run."""
        self._running.discard(key)
        self._cv.notify_all()

    def commit(self, job: DiskJob) -> bool:
        """On the job's thread: False if the job was given up, else it can no longer be."""
        with self._cv:
            if job.abandoned:
                return False
            job.committed = True
            return True

    def settle(self, job: DiskJob, wait: bool) -> bool:
        """Whether ``job`` is finished, giving it up if it is past its deadline; ``wait``: block until
        it is finished or given up (at most about ``deadline_s`` after it started)."""
        while not job.finished.is_set():
            with self._cv:
                started = job.started
                if (not job.finished.is_set() and started is not None and not job.committed
                        and time.monotonic() - started >= self.deadline_s):
                    job.abandoned = True
                    job.result = (job.kind, job.key, False)
                    job.finished.set()
                    self.abandoned += 1
                    self._done(job.key)
                    self._start()
                    logger.warning("KV page %s on disk gave no answer in %.1f s: given up (%s), its thread "
                                   "replaced (%d given up so far)", job.kind, self.deadline_s,
                                   "a miss" if job.kind == "read" else "not counted as done", self.abandoned)
                    break
            if not wait:
                return job.finished.is_set()
            left = self.deadline_s if started is None else started + self.deadline_s - time.monotonic()
            job.finished.wait(max(left, 1e-3))
        return True

    def close(self, jobs, join_s: float = 5.0) -> None:
        """Settle ``jobs`` (waiting, each within its deadline), then end the threads: each is joined for
        at most ``join_s`` seconds in all (a thread stuck on storage that hangs is left behind)."""
        for job in jobs:
            self.settle(job, wait=True)
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        deadline = time.monotonic() + join_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))


def _grouped(pairs: list[tuple[int, int]], both: bool):
    """(slot, page) pairs sorted, cut into runs of consecutive slots (``both``: and consecutive pages)."""
    pairs = sorted(pairs)
    i = 0
    while i < len(pairs):
        j = i + 1
        while (j < len(pairs) and pairs[j][0] == pairs[j - 1][0] + 1
               and (not both or pairs[j][1] == pairs[j - 1][1] + 1)):
            j += 1
        yield pairs[i:j]
        i = j


def _slot_runs(pairs: list[tuple[int, int]]):
    """(slot, page) pairs -> (range of slots, their pages in slot order), runs of consecutive slots."""
    for run in _grouped(pairs, both=False):
        yield range(run[0][0], run[-1][0] + 1), [page for _, page in run]


def _chunks(runs: list[tuple[int, list[int]]], capacity: int) -> list[list[tuple[int, list[int]]]]:
    """(first slot, pages) runs of consecutive slots, in order, cut into chunks of at most ``capacity`` pages
    (a staging buffer's fill): a chunk may hold pieces of several runs, a run may span chunks."""
    chunks: list[list[tuple[int, list[int]]]] = []
    chunk: list[tuple[int, list[int]]] = []
    size = 0
    for first, pages in runs:
        at = 0
        while at < len(pages):
            take = min(len(pages) - at, capacity - size)
            chunk.append((first + at, pages[at:at + take]))
            size, at = size + take, at + take
            if size == capacity:
                chunks.append(chunk)
                chunk, size = [], 0
    if chunk:
        chunks.append(chunk)
    return chunks


def _runs(pairs: list[tuple[int, int]]):
    """(slot, page) pairs -> (range of slots, range of pages), runs consecutive on both sides."""
    for run in _grouped(pairs, both=True):
        yield range(run[0][0], run[-1][0] + 1), range(run[0][1], run[-1][1] + 1)


def _done(event) -> bool:
    return event is None or event.query()


def _sync(event) -> None:
    """Wait for an event, or for each of a tuple of events (None: nothing to wait for)."""
    for e in event if isinstance(event, tuple) else (event,):
        if e is not None:
            e.synchronize()


# -- start-up -------------------------------------------------------------------------------------

_AUTO_HOST_FRACTION = 0.4
_AUTO_HOST_MAX_GIB = 64.0
# The CPU's host tier when only a disk tier is asked for: the disk tier stages its pages through host
# memory, and the CPU's KV cache is host memory already, so none is taken unless the disk needs it.
CPU_DISK_STAGING_GIB = 1.0


def kv_namespace(cfg, mc, kv: KVCache) -> str:
    """Model + KV layout identity for the tiers' content keys: a different model file (size, mtime),
    dummy seed, dtype, page size or shape gives different keys, so a disk tier reused across restarts
    never serves another model's or layout's KV."""
    import os

    from radixrelay.model.model_registry import resolve_model_path

    path = resolve_model_path(cfg.model)
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors")) + sorted(path.glob("*.json"))
    stamp = ",".join(f"{f.name}:{os.stat(f).st_size}:{os.stat(f).st_mtime_ns}" for f in files)
    k = kv.k[0]
    seed = f";seed={cfg.seed}" if cfg.load_format == "dummy" else ""
    tp = f";tp={cfg.tp}" if cfg.tp > 1 else ""           # kv_heads: a rank's share
    # FP8 weights change every K/V; an FP8 KV cache (emulated in a wider dtype too) stores other values
    fp8 = ((";weights=fp8-e4m3" if cfg.quantization == "fp8" else "")
           + (f";kept-layers={','.join(map(str, cfg.fp8_keep_layers))}" if cfg.fp8_keep_layers else "")
           + (";kv=fp8-e4m3" if cfg.kv_cache_dtype == "fp8" else ""))
    return (f"kvfile=layer-major-v1;model={path.resolve()};files={stamp};format={cfg.load_format}{seed};dtype={kv.dtype};"
            f"layers={kv.num_layers};page_size={kv.page_size};kv_heads={k.shape[1]};head_dim={k.shape[2]};"
            f"vocab={mc.vocab_size}{tp}{fp8}")


def host_tier_bytes(cfg, device: torch.device) -> int:
    """The host memory of one rank's tier: ``cfg.host_kv_gib`` (the server's, split evenly across
    tensor-parallel ranks) in bytes; unset: on CUDA a share of available RAM, on the CPU none, or
    ``CPU_DISK_STAGING_GIB`` with a disk tier (which stages its pages through host memory)."""
    if cfg.host_kv_gib is not None:
        return int(cfg.host_kv_gib * (1 << 30)) // cfg.tp
    if device.type != "cuda":
        return int(CPU_DISK_STAGING_GIB * (1 << 30)) // cfg.tp if cfg.disk_kv_path is not None else 0
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return 0
    return int(min(available * _AUTO_HOST_FRACTION, _AUTO_HOST_MAX_GIB * (1 << 30))) // cfg.tp


def build_tiers(cfg, mc, kv: KVCache, rank: int = 0) -> tuple[TierStore | None, int, int, str]:
    """(store, host pages, disk pages, namespace) for ``cfg`` and tensor-parallel rank ``rank``; no
    store when host memory is 0. Every rank gets the same page counts (its pages are the same size:
    its share of the KV heads) and the same namespace (the page keys); its disk files go to its own
    directory (``rank_namespace``)."""
    namespace = kv_namespace(cfg, mc, kv)
    size = page_bytes(kv)
    host_pages = host_tier_bytes(cfg, kv.device) // size
    if host_pages < 1 or cfg.disable_radix_cache:
        return None, 0, 0, namespace
    disk = None
    disk_pages = 0
    if cfg.disk_kv_path is not None:
        disk = DiskKVStore(cfg.disk_kv_path, rank_namespace(namespace, rank, cfg.tp))
        disk_pages = int(disk_tier_gib(cfg.disk_kv_path, cfg.disk_kv_gib) * (1 << 30)) // cfg.tp // disk.file_bytes(size)
        if disk_pages < 1:
            disk = None
    store = TierStore(kv, host_pages, disk)
    logger.info("KV tiers: host memory %d pages (%.1f GiB%s), disk %s", host_pages, host_pages * size / (1 << 30),
                ", pinned" if kv.device.type == "cuda" else "",
                f"{disk_pages} pages ({disk_pages * size / (1 << 30):.1f} GiB) in {disk.directory}" if disk else "off")
    return store, host_pages, disk_pages, namespace
