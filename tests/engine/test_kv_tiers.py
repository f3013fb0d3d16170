"""KV tiers through the real Engine (default model, CPU): host memory and disk behind the radix cache.

Two two-turn chat sessions (~60-word histories, ~75 tokens: past the 64 tokens a request reads from
disk at least) run on a device KV pool of 12 pages of 16 tokens, one request at a time. Greedy outputs
must equal those of recompute token for token: turn 1 runs on empty tiers, and turn 2 first runs under
another cache salt (which shares nothing with the unsalted sessions: every token computed but the
leading ones its second session shares with its first); that
run also fills the device pool, which pushes the sessions' histories out of the device cache, so the
unsalted turn 2 reads them back from the tiers.

Two engines on one disk directory (each start costs ~5 s of CPU):
1. ``host_run``: host memory 0.1 GiB and a disk tier: turn 2 hits host memory, the queued request's
   history loaded before its admission; every saved page is also written to disk (file modes);
2. ``restart_run``: host memory tiny, the same disk directory and page size (a restart): session 0 is
   served from the files run 1 left; then every ``.kv`` file is corrupted (a byte of the payload
   flipped) and session 1 finds only misses (``tier_read_failed_pages``), with outputs still equal to
   recompute.
Another page size is another namespace: a unit check of the namespace and the store below.
"""

from __future__ import annotations

import os
import random
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from radixrelay import Engine, SamplingParams
from radixrelay.radix.disk_store import HEADER

GREEDY = SamplingParams(max_tokens=4, temperature=0)
SMALL_KV = 16 * 12
WORDS = ("river stone lantern orchard copper meadow falcon harbor violet thunder maple glacier canyon "
         "ember willow quartz saddle beacon cedar marble pepper lagoon summit timber velvet comet prairie "
         "anchor basil cobalt dune fable garnet hollow ivory jasmine kettle lichen mosaic nectar").split()
FOLLOW_UP = " Summarize that in one sentence."
SALT = "recompute"


def _history(i: int) -> str:
    rng = random.Random(i)
    return f"Session {i} log: " + " ".join(rng.choice(WORDS) for _ in range(60)) + "."


HISTORIES = [_history(i) for i in range(2)]


def _kv_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kv"))


def _tier_stats(eng: Engine) -> dict:
    return {k: v for k, v in eng.stats().items() if k.startswith("tier_")}


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kv-disk")


@pytest.fixture(scope="module")
def host_run(disk_dir):
    # one request at a time: the second queues, and its history starts loading before its admission
    with Engine(kv_cache_tokens=SMALL_KV, host_kv_gib=0.1, disk_kv_path=str(disk_dir),
                max_running_requests=1) as eng:
        turn1_ids = [eng.tokenizer.encode(h) for h in HISTORIES]
        turn1 = eng.generate(turn1_ids, GREEDY)
        follow = eng.tokenizer.encode(FOLLOW_UP)
        turn2_ids = [ids + list(out.token_ids) + follow for ids, out in zip(turn1_ids, turn1)]
        recompute = eng.generate(turn2_ids, GREEDY, cache_salt=SALT)
        turn2 = eng.generate(turn2_ids, GREEDY)
        stats = eng.stats()
        modes = {p: stat.S_IMODE(os.stat(p).st_mode) for p in [*disk_dir.iterdir(), *_kv_files(disk_dir)]}
    return {"turn1": turn1, "turn2_ids": turn2_ids, "recompute": recompute, "turn2": turn2, "stats": stats,
            "modes": modes}


@pytest.fixture(scope="module")
def restart_run(host_run, disk_dir):
    turn2_ids = host_run["turn2_ids"]
    with Engine(kv_cache_tokens=SMALL_KV, host_kv_gib=0.02, disk_kv_path=str(disk_dir)) as eng:
        reused = eng.generate(turn2_ids[:1], GREEDY)
        after_reuse = _tier_stats(eng)
        corrupted = 0
        for path in _kv_files(disk_dir):
            data = bytearray(path.read_bytes())
            if len(data) > HEADER.size:                  # a byte of the payload, after the 50-byte header
                data[HEADER.size + (len(data) - HEADER.size) // 2] ^= 0xFF
                path.write_bytes(bytes(data))
                corrupted += 1
        assert corrupted > 0
        missed = eng.generate(turn2_ids[1:], GREEDY)
        after_corruption = _tier_stats(eng)
    return {"reused": reused, "after_reuse": after_reuse, "missed": missed, "after_corruption": after_corruption}


def test_references_are_recomputed(host_run):
    """Turn 1 ran on empty tiers and the salted turn 2 shared nothing with it: both are recompute's outputs
    (within each, the second session reuses only the leading tokens of the first one's first page,
    "Session ", a partial page copied)."""
    assert all(o.cached_tokens < 16 and len(o.token_ids) == GREEDY.max_tokens for o in host_run["turn1"])
    assert all(o.cached_tokens < 16 for o in host_run["recompute"])


def test_multi_turn_host_memory_tier(host_run):
    """Turn 2 on a device pool too small for the sessions: histories come back from host memory (the
    queued request's loaded while steps run, before its admission), outputs are those of recompute, and
    every turn-2 request reports cached prompt tokens."""
    assert [o.token_ids for o in host_run["turn2"]] == [o.token_ids for o in host_run["recompute"]]
    stats = host_run["stats"]
    assert stats["tier_host_pages"] > 0 and stats["tier_host_hit_tokens"] > 0
    assert 0 < stats["tier_early_load_tokens"] <= stats["tier_host_hit_tokens"]
    assert stats["tier_saved_bytes"] > 0 and stats["tier_loaded_bytes"] > 0
    assert stats["tier_disk_hit_tokens"] == 0 and stats["tier_read_failed_pages"] == 0
    for out in host_run["turn2"]:
        assert 0 < out.cached_tokens < out.prompt_tokens


def test_disk_tier_writes_saved_pages(host_run):
    """Every page saved to host memory is written to disk as well."""
    stats = host_run["stats"]
    assert stats["tier_disk_pages"] > 0 and stats["tier_written_bytes"] > 0


def test_disk_file_modes(host_run):
    """One namespace directory (0o700) of page files (0o600), whatever the umask."""
    dirs = {p: m for p, m in host_run["modes"].items() if p.suffix != ".kv"}
    files = {p: m for p, m in host_run["modes"].items() if p.suffix == ".kv"}
    assert len(dirs) == 1 and files
    assert all(m == 0o700 for m in dirs.values()), {str(p): oct(m) for p, m in dirs.items()}
    assert all(m == 0o600 for m in files.values()), {str(p): oct(m) for p, m in files.items()}


def test_restart_reads_turn_two_from_disk(host_run, restart_run):
    """A restart with the same page size finds the pages of the previous run on disk; with host memory
    too small to have kept anything, turn 2's history is read back from disk, outputs those of recompute."""
    assert [o.token_ids for o in restart_run["reused"]] == [o.token_ids for o in host_run["recompute"][:1]]
    stats = restart_run["after_reuse"]
    assert stats["tier_disk_hit_tokens"] > 0 and stats["tier_read_bytes"] > 0
    assert stats["tier_read_failed_pages"] == 0
    for out in restart_run["reused"]:
        assert out.cached_tokens > 0


def test_corrupt_pages_are_misses(host_run, restart_run):
    """Page files listed at start-up whose payload no longer verifies are misses: recomputed, counted
    in ``tier_read_failed_pages``, never served."""
    before, after = restart_run["after_reuse"], restart_run["after_corruption"]
    assert [o.token_ids for o in restart_run["missed"]] == [o.token_ids for o in host_run["recompute"][1:]]
    assert after["tier_read_failed_pages"] > 0
    assert after["tier_disk_hit_tokens"] == before["tier_disk_hit_tokens"]
    assert after["tier_host_hit_tokens"] == before["tier_host_hit_tokens"]
    assert all(out.cached_tokens < 16 for out in restart_run["missed"])    # no page served: "Session " copied


def test_other_page_size_is_another_namespace(tmp_path):
    """The tiers' namespace names the page size: a restart with page size 32 on the same directory gets
    its own namespace directory and sees none of the page-size-16 files."""
    from radixrelay.attention.kv_cache import KVCache
    from radixrelay.radix.disk_store import DiskKVStore
    from radixrelay.worker.kv_tiers import kv_namespace

    cfg = SimpleNamespace(model="default", load_format="auto", seed=0, tp=1, quantization=None,
                          kv_cache_dtype="auto", fp8_keep_layers=())
    spaces = [kv_namespace(cfg, SimpleNamespace(vocab_size=10),
                           KVCache(num_layers=1, num_pages=1, page_size=size, num_kv_heads=1, head_dim=8,
                                   dtype=torch.float32, device="cpu")) for size in (16, 32)]
    assert spaces[0] != spaces[1]
    page16 = DiskKVStore(tmp_path, spaces[0])
    page16.write(b"k" * 16, b"\1" * 64)
    page32 = DiskKVStore(tmp_path, spaces[1])
    assert page32.directory != page16.directory and page32.scan() == {}
    assert not page32.read_into(b"k" * 16, bytearray(64))
    assert DiskKVStore(tmp_path, spaces[0]).scan() == {b"k" * 16: 64}
