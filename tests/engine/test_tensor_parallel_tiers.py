"""KV tiers at ``tp=2`` on the CPU (gloo): each rank keeps its own KV heads in host memory and on disk
under the page keys every rank shares, and rank 0 acknowledges a transfer only once both ranks
completed it. Sessions pushed off a small device pool come back from host memory, then (after a
restart on the same disk directory) from disk, with the greedy tokens of ``tp=1`` without tiers.
Each rank's device seconds and rank 0's all-reduces are counted."""

from __future__ import annotations

import random

import pytest

from radixrelay import SamplingParams
from radixrelay.radix.disk_store import HEADER
from tests.engine.test_tensor_parallel import _engine, _model_dir

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
WORDS = "river stone lantern orchard copper meadow falcon harbor violet thunder maple glacier canyon".split()
SESSIONS = [f"Session {i}: " + " ".join(random.Random(i).choice(WORDS) for _ in range(70)) for i in range(4)]
DISTRACTOR = " ".join(f"note{i} alpha beta" for i in range(60))
PAGE_BYTES = 2 * 2 * 16 * 1 * 16 * 4            # a rank's page: layers x K/V x tokens x KV heads x dim x fp32
TIERS = dict(kv_cache_tokens=320, host_kv_gib=2 * 64 * PAGE_BYTES / (1 << 30))   # 64 host pages a rank


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return _model_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def reference(model):
    with _engine(model, kv_cache_tokens=4096) as engine:
        return [o.token_ids for o in engine.generate(SESSIONS, GREEDY)]


def test_host_then_disk_tiers_at_two_ranks(model, reference, tmp_path):
    disk = tmp_path / "kv"
    with _engine(model, tp=2, disk_kv_path=str(disk), **TIERS) as engine:
        first = engine.generate(SESSIONS, GREEDY)
        engine.generate([DISTRACTOR], GREEDY)                  # pushes the sessions off the device
        again = engine.generate(SESSIONS, GREEDY)
        stats = engine.stats()
    assert [o.token_ids for o in first] == [o.token_ids for o in again] == reference
    assert stats["tier_host_pages"] == 64 and stats["tier_host_hit_tokens"] >= 4 * 64
    assert all(o.cached_tokens > 0 for o in again)
    assert stats["rank0_device_s"] > 0 and stats["rank1_device_s"] > 0
    # the embedding's and two per layer, every forward, each timed (gloo)
    assert stats["tp_all_reduces"] >= 5 * stats["steps"] // 2 and stats["tp_all_reduce_s"] > 0
    # one directory per rank, holding the same pages (each its rank's share of the KV heads)
    ranks = sorted(disk.iterdir())
    assert len(ranks) == 2
    names = [sorted(p.name for p in d.glob("*.kv")) for d in ranks]
    assert names[0] and names[0] == names[1]
    assert all(p.stat().st_size == HEADER.size + PAGE_BYTES for d in ranks for p in d.glob("*.kv"))

    with _engine(model, tp=2, disk_kv_path=str(disk), **TIERS) as engine:      # a restart
        restarted = engine.generate(SESSIONS, GREEDY)
        stats = engine.stats()
    assert [o.token_ids for o in restarted] == reference
    assert stats["tier_disk_hit_tokens"] >= 4 * 64 and stats["tier_read_failed_pages"] == 0


def test_a_page_missing_on_one_rank_is_a_miss_on_both(model, reference, tmp_path):
    """Files one rank's directory lacks are not indexed at a restart: the pages are recomputed, and the
    tokens stay those of tp=1."""
    disk = tmp_path / "kv"
    with _engine(model, tp=2, disk_kv_path=str(disk), **TIERS) as engine:
        engine.generate(SESSIONS, GREEDY)
    first, second = sorted(disk.iterdir())
    for path in second.glob("*.kv"):
        path.unlink()
    assert list(first.glob("*.kv"))
    with _engine(model, tp=2, disk_kv_path=str(disk), **TIERS) as engine:
        outs = engine.generate(SESSIONS, GREEDY)
        stats = engine.stats()
    assert [o.token_ids for o in outs] == reference
    assert stats["tier_disk_hit_tokens"] == 0 and stats["tier_read_failed_pages"] == 0
