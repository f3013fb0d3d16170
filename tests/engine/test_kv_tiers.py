"""KV tiers through the real Engine (default model, CPU): host memory and disk behind the radix cache.

Six two-turn chat sessions (~60-word histories, ~75 tokens) run on a device KV pool of 40 pages of
16 tokens: too small for the sessions plus an unrelated ~440-token prompt run between the turns,
which pushes the sessions out of the device cache, so turn 2 reads its history back from the tiers. Greedy outputs must equal those of a recompute engine
(large device pool, no tiers) token for token. The turn-2 prompts are token ids built from the
recompute engine's turn-1 outputs, so every engine gets the same prompts.

Four engines (each start costs ~10 s; the page-size-32 restart doubles as the host-memory run to
stay at four), in this order, runs 2-4 on one disk directory:
1. ``reference``: kv 16 * 400 tokens, no tiers;
2. ``disk_run``: kv 16 * 40, host memory tiny, disk tier: turn 2 hits the disk; file modes;
3. ``host_run``: kv 16 * 40, host memory 0.5 GiB, the same disk directory but page size 32 (another
   namespace: nothing of run 2 matches), two requests at a time: turn 2 hits host memory, the queued
   requests' histories loaded before their admission;
4. ``restart_run``: the options of run 2 again (a restart): sessions 0-2 are served from the files
   run 2 left; then every ``.kv`` file is corrupted (a byte of the payload flipped) and sessions 3-5
   find only misses (``tier_read_failed_pages``), with outputs still equal to recompute.
"""

from __future__ import annotations

import os
import random
import stat
from pathlib import Path

import pytest

from radixrelay import Engine, SamplingParams
from radixrelay.radix.disk_store import HEADER

GREEDY = SamplingParams(max_tokens=8, temperature=0)
SMALL_KV = 16 * 40
WORDS = ("river stone lantern orchard copper meadow falcon harbor violet thunder maple glacier canyon "
         "ember willow quartz saddle beacon cedar marble pepper lagoon summit timber velvet comet prairie "
         "anchor basil cobalt dune fable garnet hollow ivory jasmine kettle lichen mosaic nectar").split()
FOLLOW_UP = " Summarize that in one sentence."
DISTRACTOR = " ".join(f"note{i} alpha beta" for i in range(90))      # ~440 tokens, shares nothing


def _history(i: int) -> str:
    rng = random.Random(i)
    return f"Session {i} log: " + " ".join(rng.choice(WORDS) for _ in range(60)) + "."


HISTORIES = [_history(i) for i in range(6)]


def _turn2(tokenizer, turn1_ids: list[list[int]], outputs) -> list[list[int]]:
    follow = tokenizer.encode(FOLLOW_UP)
    return [ids + list(out.token_ids) + follow for ids, out in zip(turn1_ids, outputs)]


def _kv_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kv"))


def _tier_stats(eng: Engine) -> dict:
    return {k: v for k, v in eng.stats().items() if k.startswith("tier_")}


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kv-disk")


@pytest.fixture(scope="module")
def reference():
    with Engine(kv_cache_tokens=16 * 400, host_kv_gib=0) as eng:
        turn1_ids = [eng.tokenizer.encode(h) for h in HISTORIES]
        turn1 = eng.generate(turn1_ids, GREEDY)
        turn2_ids = _turn2(eng.tokenizer, turn1_ids, turn1)
        assert eng.flush_cache()                # turn 2 recomputed from scratch too
        turn2 = eng.generate(turn2_ids, GREEDY)
        assert eng.stats()["tier_host_pages"] == 0
    return {"turn1_ids": turn1_ids, "turn1": [o.token_ids for o in turn1],
            "turn2_ids": turn2_ids, "turn2": [o.token_ids for o in turn2]}


def _two_turns(eng: Engine, ref: dict) -> dict:
    """Turn 1 of every session, the distractor, turn 2 of every session; outputs and tier stats."""
    turn1 = eng.generate(ref["turn1_ids"], GREEDY)
    after_turn1 = _tier_stats(eng)
    eng.generate([DISTRACTOR], GREEDY)
    turn2 = eng.generate(ref["turn2_ids"], GREEDY)
    return {"turn1": turn1, "turn2": turn2, "after_turn1": after_turn1, "stats": eng.stats()}


@pytest.fixture(scope="module")
def disk_run(reference, disk_dir):
    with Engine(kv_cache_tokens=SMALL_KV, host_kv_gib=0.02, disk_kv_path=str(disk_dir)) as eng:
        run = _two_turns(eng, reference)
        run["modes"] = {p: stat.S_IMODE(os.stat(p).st_mode) for p in [*disk_dir.iterdir(), *_kv_files(disk_dir)]}
    run["namespaces"] = {p.name for p in disk_dir.iterdir()}
    return run


@pytest.fixture(scope="module")
def host_run(reference, disk_run, disk_dir):
    # two requests at a time: the rest of turn 2 queues, and its histories start loading before admission
    with Engine(kv_cache_tokens=SMALL_KV, host_kv_gib=0.5, page_size=32, disk_kv_path=str(disk_dir),
                max_running_requests=2) as eng:
        return _two_turns(eng, reference)


@pytest.fixture(scope="module")
def restart_run(reference, disk_run, host_run, disk_dir):
    with Engine(kv_cache_tokens=SMALL_KV, host_kv_gib=0.02, disk_kv_path=str(disk_dir)) as eng:
        reused = eng.generate(reference["turn2_ids"][:3], GREEDY)
        after_reuse = _tier_stats(eng)
        corrupted = 0
        for path in _kv_files(disk_dir):
            data = bytearray(path.read_bytes())
            if len(data) > HEADER.size:                  # a byte of the payload, after the 50-byte header
                data[HEADER.size + (len(data) - HEADER.size) // 2] ^= 0xFF
                path.write_bytes(bytes(data))
                corrupted += 1
        assert corrupted > 0
        missed = eng.generate(reference["turn2_ids"][3:], GREEDY)
        after_corruption = _tier_stats(eng)
    return {"reused": reused, "after_reuse": after_reuse, "missed": missed, "after_corruption": after_corruption}


def test_multi_turn_host_memory_tier(reference, host_run):
    """Turn 2 on a device pool too small for the sessions: histories come back from host memory (those of
    queued requests loaded while steps run, before their admission), outputs are those of recompute, and
    every turn-2 request reports cached prompt tokens."""
    assert [o.token_ids for o in host_run["turn1"]] == reference["turn1"]
    assert [o.token_ids for o in host_run["turn2"]] == reference["turn2"]
    stats = host_run["stats"]
    assert stats["tier_host_pages"] > 0 and stats["tier_host_hit_tokens"] > 0
    assert 0 < stats["tier_early_load_tokens"] <= stats["tier_host_hit_tokens"]
    assert stats["tier_saved_bytes"] > 0 and stats["tier_loaded_bytes"] > 0
    for out in host_run["turn2"]:
        assert 0 < out.cached_tokens < out.prompt_tokens


def test_disk_tier_serves_turn_two(reference, disk_run):
    """Host memory too small for the sessions: turn 2's histories are read back from disk."""
    assert [o.token_ids for o in disk_run["turn1"]] == reference["turn1"]
    assert [o.token_ids for o in disk_run["turn2"]] == reference["turn2"]
    stats = disk_run["stats"]
    assert stats["tier_disk_pages"] > 0 and stats["tier_written_bytes"] > 0
    assert stats["tier_disk_hit_tokens"] > 0 and stats["tier_read_bytes"] > 0
    assert stats["tier_read_failed_pages"] == 0
    # Not every session: which turn-2 requests find host slots for their disk pages depends on
    # arrival timing while the distractor's pages are still protected (stale look-ahead protection,
    # tests/radix/test_tiers_state_machine.py::test_protection_ends_with_the_window).
    assert any(out.cached_tokens > 0 for out in disk_run["turn2"])


def test_disk_file_modes(disk_run):
    """One namespace directory (0o700) of page files (0o600), whatever the umask."""
    dirs = {p: m for p, m in disk_run["modes"].items() if p.suffix != ".kv"}
    files = {p: m for p, m in disk_run["modes"].items() if p.suffix == ".kv"}
    assert len(dirs) == 1 and files
    assert all(m == 0o700 for m in dirs.values()), {str(p): oct(m) for p, m in dirs.items()}
    assert all(m == 0o600 for m in files.values()), {str(p): oct(m) for p, m in files.items()}


def test_other_page_size_is_another_namespace(disk_run, host_run, disk_dir):
    """A restart with page size 32 on the same directory sees none of the page-size-16 files (its
    turn 1 is on disk for page size 16): no disk hits, its own namespace directory."""
    assert host_run["after_turn1"]["tier_disk_hit_tokens"] == 0
    assert host_run["stats"]["tier_disk_hit_tokens"] == 0
    assert host_run["stats"]["tier_read_failed_pages"] == 0
    namespaces = {p.name for p in disk_dir.iterdir()}
    assert disk_run["namespaces"] < namespaces and len(namespaces) == 2


def test_restart_reuses_disk(reference, restart_run):
    """A restart with the same options finds the pages of the previous run on disk."""
    assert [o.token_ids for o in restart_run["reused"]] == reference["turn2"][:3]
    assert restart_run["after_reuse"]["tier_disk_hit_tokens"] > 0
    assert restart_run["after_reuse"]["tier_read_failed_pages"] == 0
    for out in restart_run["reused"]:
        assert out.cached_tokens > 0


def test_corrupt_pages_are_misses(reference, restart_run):
    """Page files listed at start-up whose payload no longer verifies are misses: recomputed, counted
    in ``tier_read_failed_pages``, never served."""
    before, after = restart_run["after_reuse"], restart_run["after_corruption"]
    assert [o.token_ids for o in restart_run["missed"]] == reference["turn2"][3:]
    assert after["tier_read_failed_pages"] > 0
    assert after["tier_disk_hit_tokens"] == before["tier_disk_hit_tokens"]
    assert after["tier_host_hit_tokens"] == before["tier_host_hit_tokens"]
    assert all(out.cached_tokens == 0 for out in restart_run["missed"])
