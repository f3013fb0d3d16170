"""TierStore (worker side of the KV tiers): copies between device pages, host slots and disk files
are exact, in plan order, and acknowledged once; on CUDA the same through the copy stream."""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest
import torch

from radixrelay.attention import KVCache
from radixrelay.protocol.kv import KVTransfers
from radixrelay.radix.disk_store import DiskKVStore
from radixrelay.worker.kv_tiers import TierStore, page_bytes

PS = 4


def _cache(device: str, dtype=torch.float32) -> KVCache:
    kv = KVCache(num_layers=3, num_pages=12, page_size=PS, num_kv_heads=2, head_dim=8, dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(0)
    for t in kv.k + kv.v:
        t.copy_(torch.randn(t.shape, generator=gen).to(dtype))
    return kv


def _page(kv: KVCache, page: int) -> torch.Tensor:
    rows = slice(page * PS, (page + 1) * PS)
    raw = (lambda t: t.view(torch.uint8)) if kv.dtype.itemsize == 1 else (lambda t: t)    # FP8 pages as bytes
    return torch.stack([torch.stack([raw(kv.k[l][rows]), raw(kv.v[l][rows])]) for l in range(kv.num_layers)]).cpu()


def _round_trip(device: str, tmp_path, dtype=torch.float32) -> None:
    kv = _cache(device, dtype)
    store = TierStore(kv, host_pages=6, disk=DiskKVStore(tmp_path, "ns"))
    before = {p: _page(kv, p) for p in range(12)}
    # pages 2, 3, 4 (a run) and 9 -> slots 0, 1, 2 and 5; then written to disk
    store.apply(0, KVTransfers(saves=[(2, 0), (3, 1), (4, 2), (9, 5)]))
    store.apply(1, KVTransfers(disk_writes=[(5, b"k" * 16)]))
    acks = store.acks(wait=True)
    assert acks.saved_steps == [0] and acks.written == [b"k" * 16] and not acks.failed_steps
    assert acks.save_s > 0
    # reuse slot 5 for another page, read the disk copy back into slot 4, load everything into 6..10
    store.apply(2, KVTransfers(saves=[(0, 5)], disk_reads=[(b"k" * 16, 4)]))
    acks = store.acks(wait=True)
    assert acks.saved_steps == [2] and acks.read == [b"k" * 16]
    store.apply(3, KVTransfers(loads=[(0, 6), (1, 7), (2, 8), (4, 10), (5, 11)]))
    acks = store.acks(wait=True)
    assert acks.load_s > 0 and acks.load_exposed_s >= 0
    if device == "cpu":                      # synchronous: all of it exposed
        assert acks.load_exposed_s == acks.load_s
    assert kv.layer_ready is None or len(kv.layer_ready) == kv.num_layers
    for src, dst in ((2, 6), (3, 7), (4, 8), (9, 10), (0, 11)):
        assert torch.equal(_page(kv, dst), before[src]), (src, dst)
    assert store.acks(wait=True) is None          # each completion is acknowledged once
    # a missing file is a failed read, never an exception
    store.apply(4, KVTransfers(disk_reads=[(b"m" * 16, 3)]))
    assert store.acks(wait=True).read_failed == [b"m" * 16]
    assert store.page_bytes == page_bytes(kv) == 3 * 2 * PS * 2 * 8 * torch.tensor([], dtype=dtype).element_size()
    store.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn], ids=["fp32", "fp8"])
def test_round_trip_cpu(tmp_path, dtype):
    _round_trip("cpu", tmp_path, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_round_trip_cuda(tmp_path, dtype):
    _round_trip("cuda", tmp_path, dtype)
    kv = _cache("cuda", dtype)
    store = TierStore(kv, host_pages=4)
    assert store.host.is_pinned()
    store.close()


def _scattered_saves(device: str, monkeypatch) -> None:
    """Saves whose host slots are consecutive but whose device pages are scattered (a request's decode
    pages) are gathered, every layer at once, through the staging buffer, in chunks of its size (a
    chunk may hold pieces of several slot runs, a slot run may span chunks); runs consecutive on both
    sides are copied straight; every slot then holds exactly its page."""
    import radixrelay.worker.kv_tiers as kv_tiers

    kv = _cache(device)
    monkeypatch.setattr(kv_tiers, "STAGE_BYTES", 2 * page_bytes(kv))
    store = TierStore(kv, host_pages=16)
    assert store._stage_pages == 2
    before = {p: _page(kv, p) for p in range(12)}
    # two slot runs of scattered pages, 8 pages: chunks [slots 0, 1], [2, 3], [4, 12], [13, 14]
    scattered = [(7, 0), (2, 1), (10, 2), (4, 3), (0, 4), (3, 12), (1, 13), (9, 14)]     # (page, slot)
    straight = [(5, 8), (6, 9)]
    store.apply(0, KVTransfers(saves=scattered + straight + [(11, 6)]))
    assert store.acks(wait=True).saved_steps == [0]
    host = store.host.cpu()
    for page, slot in scattered + straight + [(11, 6)]:
        rows = slice(slot * PS, (slot + 1) * PS)
        assert torch.equal(host[:, :, rows], before[page]), (page, slot)
    # and back: load them into other pages
    store.apply(1, KVTransfers(loads=[(0, 1), (4, 3)]))
    store.acks(wait=True)
    assert torch.equal(_page(kv, 1), before[7]) and torch.equal(_page(kv, 3), before[0])
    store.close()


def test_scattered_saves_cpu(monkeypatch):
    _scattered_saves("cpu", monkeypatch)


@pytest.mark.gpu
def test_scattered_saves_cuda(monkeypatch):
    _scattered_saves("cuda", monkeypatch)


def _scattered_loads(device: str, dtype, monkeypatch) -> None:
    """Loads whose host slots are consecutive but whose device pages are scattered (a history loaded into
    a fragmented pool) go through the load staging buffer: per layer group, a copy per piece into the stage
    and one scatter into the pages, in chunks of the stage's size (a chunk may hold pieces of several slot
    runs, a slot run may span chunks); runs of at most two straight runs are copied straight. Every page
    then holds exactly its slot (FP8 as bytes), and pages no load names are untouched."""
    import radixrelay.worker.kv_tiers as kv_tiers

    kv = _cache(device, dtype)
    monkeypatch.setattr(kv_tiers, "LOAD_LAYERS_PER_EVENT", 2)                 # groups: layers [0, 1], [2]
    monkeypatch.setattr(kv_tiers, "LOAD_STAGE_BYTES", 4 * page_bytes(kv) // kv.num_layers * 2)
    store = TierStore(kv, host_pages=16)
    assert store._load_stage_pages == 4
    gen = torch.Generator().manual_seed(1)
    store.host.copy_(torch.randn(store.host.shape, generator=gen).to(dtype))
    host = store.host.cpu()
    untouched = _page(kv, 3)
    scattered = [(0, 9), (1, 2), (2, 7), (3, 0), (4, 5), (5, 11), (13, 10), (14, 1), (15, 8)]   # (slot, page)
    straight = [(10, 4), (11, 6)]                                 # two runs: copied straight
    direct, staged = store._load_plan(scattered + straight)
    assert direct == [(range(10, 11), range(4, 5)), (range(11, 12), range(6, 7))]
    assert [pieces for pieces, _ in staged] == [[(0, 4)], [(4, 2), (13, 2)], [(15, 1)]]
    assert [rows.numel() for _, rows in staged] == [4 * PS, 4 * PS, PS]
    store.apply(0, KVTransfers(loads=scattered + straight))
    store.acks(wait=True)
    raw = (lambda t: t.view(torch.uint8)) if dtype.itemsize == 1 else (lambda t: t)
    for slot, page in scattered + straight:
        assert torch.equal(_page(kv, page), raw(host[:, :, slot * PS:(slot + 1) * PS])), (slot, page)
    assert torch.equal(_page(kv, 3), untouched)
    store.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn], ids=["fp32", "fp8"])
def test_loads_into_scattered_pages_go_through_the_staging_buffer_cpu(dtype, monkeypatch):
    _scattered_loads("cpu", dtype, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=["fp32", "bf16", "fp8"])
def test_loads_into_scattered_pages_go_through_the_staging_buffer_cuda(dtype, monkeypatch):
    _scattered_loads("cuda", dtype, monkeypatch)


@pytest.mark.gpu
def test_a_large_save_is_not_settled_while_it_copies_cuda():
    """``settled`` (what the worker checks before answering a plan of transfers alone) is False while a large
    save still copies and True once it is done, without waiting: the worker never blocks on it, so a request
    arriving right after a long prompt was computed is launched before that prompt's save completes."""
    kv = KVCache(num_layers=8, num_pages=1024, page_size=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                 device="cuda")                                               # 512 MiB of K/V
    store = TierStore(kv, host_pages=1024)
    store.apply(0, KVTransfers(saves=[(p, p) for p in range(1024)]))
    store.after_forward()
    assert not store.settled()
    store.acks(wait=True)
    assert store.settled()
    store.close()


def test_saves_are_queued_after_the_forward_cpu():
    """A plan's saves are launched once its forward was queued (``after_forward``), not before it; a plan
    that loads from a slot it also saves queues the save first; ``acks`` never loses a recorded save."""
    kv = _cache("cpu")
    store = TierStore(kv, host_pages=4)
    store.host.fill_(-1.0)
    before = {p: _page(kv, p) for p in range(12)}
    store.apply(0, KVTransfers(saves=[(2, 0)]))
    assert (store.host[:, :, 0:PS] == -1).all()                  # recorded, not yet queued
    store.after_forward()
    assert torch.equal(store.host[:, :, 0:PS], before[2])
    store.apply(1, KVTransfers(saves=[(3, 1)], loads=[(1, 5)]))  # loads what it saves: save first
    assert torch.equal(_page(kv, 5), before[3])
    store.apply(2, KVTransfers(saves=[(4, 2)]))
    assert store.acks(wait=True).saved_steps == [0, 1, 2]       # step 2's save queued by acks
    assert torch.equal(store.host[:, :, 2 * PS:3 * PS], before[4])
    store.close()


def _shifted_load(device: str, dtype, tol: float, dest=(8, 9, 10)) -> None:
    """A shifted load rotates the keys by the delta: K computed at position p arrives as K at p + d
    (RoPE of the default-like config), values and other pages untouched; into scattered pages too (the
    load staging buffer: the rotation follows the scatter)."""
    from radixrelay.model.model_config import ModelConfig
    from radixrelay.model.layers import RotaryEmbedding, apply_rope

    kv = _cache(device, dtype)
    rotary = RotaryEmbedding(ModelConfig("llama", 32, hidden_size=16, intermediate_size=32, num_layers=3, num_heads=2,
                                         num_kv_heads=2, head_dim=8), device=device)
    store = TierStore(kv, host_pages=4)
    store.rotary = rotary
    raw = torch.randn(kv.num_layers, 3 * PS, 2, 8, dtype=torch.float64)     # keys before RoPE
    positions = torch.arange(40, 40 + 3 * PS, device=device)                # pages 5, 6, 7 at 40..51
    cos, sin = rotary(positions)
    for layer in range(kv.num_layers):
        kv.k[layer][5 * PS:8 * PS] = apply_rope(raw[layer].to(device).float(), cos, sin).to(dtype)
    store.apply(0, KVTransfers(saves=[(5, 0), (6, 1), (7, 2)]))
    store.acks(wait=True)
    v_before = [kv.v[l][5 * PS:8 * PS].cpu().clone() for l in range(kv.num_layers)]
    other = _page(kv, 0)
    store.apply(1, KVTransfers(shifted_loads=[(i, page, -32) for i, page in enumerate(dest)]))   # -> 8..19
    store.after_forward()
    store.acks(wait=True)
    cos, sin = rotary(positions - 32)
    rows = torch.cat([torch.arange(page * PS, (page + 1) * PS) for page in dest]).to(device)
    for layer in range(kv.num_layers):
        want = apply_rope(raw[layer].to(device).float(), cos, sin).cpu().double()
        got = kv.k[layer][rows].cpu().double()
        assert torch.allclose(got, want, atol=tol, rtol=tol), (layer, (got - want).abs().max())
        assert torch.equal(kv.v[layer][rows].cpu().float(), v_before[layer].float())
    assert torch.equal(_page(kv, 0), other)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float8_e4m3fn, 0.15)], ids=["fp32", "fp8"])
@pytest.mark.parametrize("dest", [(8, 9, 10), (10, 3, 8)], ids=["straight", "scattered"])
def test_shifted_load_rotates_keys_cpu(dtype, tol, dest):
    _shifted_load("cpu", dtype, tol, dest)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float8_e4m3fn, 0.15)])
def test_shifted_load_rotates_keys_cuda(dtype, tol):
    _shifted_load("cuda", dtype, tol)


class _HungDisk(DiskKVStore):
    """A real disk store whose reads of ``hung`` keys do not return until ``release`` is set: a stand-in
    for storage that stops answering (a hung network mount), which a test cannot produce for real."""

    def __init__(self, root, hung: set[bytes]) -> None:
        super().__init__(root, "ns")
        self.hung = hung
        self.release = threading.Event()
        self.returned = threading.Event()

    def read_into(self, key, out) -> bool:
        if key in self.hung:
            self.release.wait()
            ok = super().read_into(key, out)
            self.returned.set()
            return ok
        return super().read_into(key, out)


def test_disk_read_past_its_deadline_is_a_miss(tmp_path):
    """A disk read that does not answer within the deadline is reported as a miss; the reads queued
    after it still complete (on a fresh I/O thread) and ``acks(wait=True)`` returns; when the hung read
    finally returns it leaves its host slot alone (the scheduler may have reused it)."""
    kv = _cache("cpu")
    disk = _HungDisk(tmp_path, hung={b"h" * 16})
    store = TierStore(kv, host_pages=6, disk=disk, disk_deadline_s=0.3)
    before = {p: _page(kv, p) for p in range(12)}
    store.apply(0, KVTransfers(saves=[(1, 0), (2, 1)]))
    store.apply(1, KVTransfers(disk_writes=[(0, b"h" * 16), (1, b"k" * 16)]))
    assert store.acks(wait=True).written == [b"h" * 16, b"k" * 16]
    store.host[:, :, 3 * PS:5 * PS] = -1.0
    start = time.monotonic()
    store.apply(2, KVTransfers(disk_reads=[(b"h" * 16, 3), (b"k" * 16, 4)]))
    assert store.acks(wait=False) is None                # in flight: nothing to report yet
    assert not store.settled()                           # ... and a plan of transfers alone would not wait
    acks = store.acks(wait=True)
    assert store.settled()
    took = time.monotonic() - start
    assert acks.read_failed == [b"h" * 16] and acks.read == [b"k" * 16]
    assert 0.3 <= took < 5, took
    assert store._io.abandoned == 1
    host = store.host
    assert torch.equal(host[:, :, 4 * PS:5 * PS], before[2])
    host[:, :, 3 * PS:4 * PS] = 7.0                       # the slot, reused for something else
    disk.release.set()
    assert disk.returned.wait(5)
    time.sleep(0.05)
    assert (host[:, :, 3 * PS:4 * PS] == 7.0).all()      # the late read copied nothing into it
    # the tier goes on working: the same page reads back now
    store.apply(3, KVTransfers(disk_reads=[(b"k" * 16, 5)]))
    assert store.acks(wait=True).read == [b"k" * 16]
    assert torch.equal(host[:, :, 5 * PS:6 * PS], before[2])
    store.close()


def test_disk_tier_skips_a_fifo_in_place_of_a_page(tmp_path):
    """A FIFO where a page file was is a read miss at once; the pages after it are read."""
    kv = _cache("cpu")
    disk = DiskKVStore(tmp_path, "ns")
    store = TierStore(kv, host_pages=6, disk=disk, disk_deadline_s=30.0)
    before = _page(kv, 2)
    store.apply(0, KVTransfers(saves=[(1, 0), (2, 1)]))
    store.apply(1, KVTransfers(disk_writes=[(0, b"f" * 16), (1, b"k" * 16)]))
    store.acks(wait=True)
    path = disk.directory / ((b"f" * 16).hex() + ".kv")
    os.unlink(path)
    os.mkfifo(path, 0o600)
    start = time.monotonic()
    store.apply(2, KVTransfers(disk_reads=[(b"f" * 16, 3), (b"k" * 16, 4)]))
    acks = store.acks(wait=True)
    assert time.monotonic() - start < 10
    assert acks.read_failed == [b"f" * 16] and acks.read == [b"k" * 16]
    assert torch.equal(store.host[:, :, 4 * PS:5 * PS], before)
    assert disk.refused == 1 and store._io.abandoned == 0
    store.close()


class _FullDisk(DiskKVStore):
    """A real disk store whose writes fail with ENOSPC while ``full`` is set (a full file system or quota,
    which a test cannot produce for real without privileges)."""

    def __init__(self, root) -> None:
        super().__init__(root, "ns")
        self.full = True
        self.attempts = 0

    def write(self, key, data) -> int:
        self.attempts += 1
        if self.full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write(key, data)


def test_a_full_disk_pauses_writes_and_reads_go_on(tmp_path, caplog, monkeypatch):
    """ENOSPC: the write fails (reported, counted), one warning, the next writes fail at once without
    touching the disk for DISK_FULL_PAUSE_S; pages already on disk are still read; after the pause
    writes are tried again and succeed once there is room."""
    from radixrelay.worker import kv_tiers

    kv = _cache("cpu")
    disk = _FullDisk(tmp_path)
    store = TierStore(kv, host_pages=6, disk=disk, disk_deadline_s=30.0)
    disk.full = False
    store.apply(0, KVTransfers(saves=[(1, 0), (2, 1), (3, 2)]))
    store.apply(1, KVTransfers(disk_writes=[(0, b"a" * 16)]))
    assert store.acks(wait=True).written == [b"a" * 16]
    disk.full = True
    caplog.set_level("WARNING", logger="radixrelay.worker")
    store.apply(2, KVTransfers(disk_writes=[(1, b"b" * 16)]))
    assert store.acks(wait=True).write_failed == [b"b" * 16] and disk.attempts == 2
    store.apply(3, KVTransfers(disk_writes=[(2, b"c" * 16)]))
    assert store.acks(wait=True).write_failed == [b"c" * 16] and disk.attempts == 2   # not even tried
    assert store.stats().full_writes == 2
    assert len([r for r in caplog.records if "disk is full" in r.message]) == 1
    store.apply(4, KVTransfers(disk_reads=[(b"a" * 16, 5)]))
    assert store.acks(wait=True).read == [b"a" * 16]
    assert torch.equal(store.host[:, :, 5 * PS:6 * PS], store.host[:, :, 0:PS])
    disk.full = False
    monkeypatch.setattr(store, "_full_until", 0.0)                             # the pause is over
    store.apply(5, KVTransfers(disk_writes=[(1, b"b" * 16)]))
    assert store.acks(wait=True).written == [b"b" * 16]
    assert kv_tiers.DISK_FULL_PAUSE_S >= 1 and store.stats().write_s > 0 and store.stats().read_s > 0
    store.close()


def test_a_removed_directory_is_made_again(tmp_path):
    """The namespace directory removed while serving: the files in it are misses, the next write makes
    the directory again (0o700) and lands."""
    import shutil
    import stat

    disk = DiskKVStore(tmp_path, "ns")
    page = bytes(range(256)) * 4
    disk.write(b"a" * 16, page)
    shutil.rmtree(disk.directory)
    out = bytearray(len(page))
    assert not disk.read_into(b"a" * 16, out)
    disk.write(b"b" * 16, page)
    assert disk.recreated == 1 and stat.S_IMODE(os.stat(disk.directory).st_mode) == 0o700
    assert disk.read_into(b"b" * 16, out) and bytes(out) == page


@pytest.mark.gpu
@pytest.mark.parametrize("start_now", [True, False])
def test_loads_start_now_beside_the_steps_queued_before_cuda(start_now):
    """A plan whose loads may start at once (``loads_start_now``: no step in flight writes their pages)
    copies while the compute stream is still busy with earlier work; otherwise the copies wait for it.
    Either way the pages arrive exact and the step's layers wait for them."""
    kv = _cache("cuda")
    store = TierStore(kv, host_pages=6)
    store.host.normal_()
    want = store.host[:, :, :3 * PS].clone()
    compute = torch.cuda.current_stream()
    torch.cuda._sleep(500_000_000)                 # earlier steps, still on the device (~0.3 s)
    busy = torch.cuda.Event()
    busy.record(compute)
    store.apply(0, KVTransfers(loads=[(0, 6), (1, 7), (2, 8)], loads_start_now=start_now))
    loaded = kv.layer_ready[-1]
    loaded.synchronize()
    assert busy.query() is (not start_now)         # started now: done while the earlier work still runs
    if start_now:                                  # acknowledged before its step could start: none exposed
        acks = store.acks(wait=False)
        assert acks.load_s > 0 and acks.load_exposed_s == 0.0
    store.after_forward()
    torch.cuda.synchronize()
    for layer in range(kv.num_layers):
        got = torch.stack([kv.k[layer][6 * PS:9 * PS], kv.v[layer][6 * PS:9 * PS]]).cpu()
        assert torch.equal(got, want[layer])
    assert start_now or store.acks(wait=True).load_s > 0
    store.close()


@pytest.mark.gpu
def test_loads_of_a_plan_without_rows_are_waited_for_by_the_next_step_layer_by_layer_cuda():
    """A plan of transfers alone (loads at a request's arrival) leaves its per-layer events for the next
    step with rows: its layer l waits for layer l only. A decode step (a whole-model graph) waits for all."""
    kv = _cache("cuda")
    store = TierStore(kv, host_pages=6)
    store.host.normal_()
    want = store.host[:, :, :3 * PS].clone()
    torch.cuda._sleep(100_000_000)                 # a step in flight
    store.apply(0, KVTransfers(loads=[(0, 6), (1, 7), (2, 8)], loads_start_now=True))
    store.after_forward(rows=False)
    assert kv.layer_ready is not None              # nothing made the compute stream wait yet
    got = []
    for layer in range(kv.num_layers):             # the next step, layer by layer
        kv.wait_for_layer(layer)
        got.append(torch.stack([kv.k[layer][6 * PS:9 * PS], kv.v[layer][6 * PS:9 * PS]]).clone())
    store.after_forward(rows=True)
    assert kv.layer_ready is None
    store.apply(1, KVTransfers(loads=[(3, 9)], loads_start_now=True))
    store.after_forward(rows=False)
    store.wait_for_loads()                         # a decode step: everything before it
    assert kv.layer_ready is None
    after = torch.stack([kv.k[0][9 * PS:10 * PS], kv.v[0][9 * PS:10 * PS]]).clone()
    torch.cuda.synchronize()
    for layer in range(kv.num_layers):
        assert torch.equal(got[layer].cpu(), want[layer])
    assert torch.equal(after.cpu(), store.host[0, :, 3 * PS:4 * PS])
    store.close()
