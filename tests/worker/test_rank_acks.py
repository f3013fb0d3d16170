"""``RankAcks``: rank 0 acknowledges a KV transfer only once every tensor-parallel rank completed it,
and as failed if any rank failed it."""

from __future__ import annotations

import pytest

from radixrelay.protocol.kv import KVAcks
from radixrelay.worker.rank_acks import RankAcks

A, B = b"a" * 16, b"b" * 16


def test_a_save_is_acknowledged_once_every_rank_saved_it():
    merged = RankAcks(3)
    merged.add(0, KVAcks(saved_steps=[1, 2]))
    merged.add(2, KVAcks(saved_steps=[1]))
    assert merged.take() is None                       # rank 1 has reported nothing
    merged.add(1, KVAcks(saved_steps=[1, 2]))
    assert merged.take().saved_steps == [1]
    assert merged.pending() == 1                       # step 2: rank 2 missing
    merged.add(2, KVAcks(saved_steps=[2]))
    acks = merged.take()
    assert acks.saved_steps == [2] and acks.failed_steps == []
    assert merged.pending() == 0 and merged.take() is None


def test_a_failure_on_any_rank_fails_the_transfer():
    merged = RankAcks(2)
    merged.add(0, KVAcks(saved_steps=[7], written=[A], read=[B]))
    merged.add(1, KVAcks(failed_steps=[7], write_failed=[A], read=[B]))
    acks = merged.take()
    assert (acks.saved_steps, acks.failed_steps) == ([], [7])
    assert (acks.written, acks.write_failed) == ([], [A])
    assert (acks.read, acks.read_failed) == ([B], [])


def test_repeated_items_pair_up_in_order():
    """The same key read twice (a read, an eviction, a read again): each rank's i-th report of it is
    the i-th read, whatever order the ranks' reports arrive in."""
    merged = RankAcks(2)
    merged.add(0, KVAcks(read_failed=[A]))
    merged.add(0, KVAcks(read=[A]))
    assert merged.take() is None
    merged.add(1, KVAcks(read=[A]))                    # its first read succeeded, rank 0's failed
    assert merged.take().read_failed == [A]
    merged.add(1, KVAcks(read=[A]))
    assert merged.take().read == [A]
    assert merged.pending() == 0


def test_load_times_are_rank_zeros_and_none_counts_nothing():
    merged = RankAcks(2)
    merged.add(1, KVAcks(load_s=5.0, load_exposed_s=1.0))
    merged.add(1, None)
    assert merged.take() is None
    merged.add(0, KVAcks(load_s=0.25, load_exposed_s=0.125, save_s=0.5))
    acks = merged.take()
    assert (acks.load_s, acks.load_exposed_s, acks.save_s) == (0.25, 0.125, 0.5)


def test_one_rank_passes_through_and_bad_ranks_are_refused():
    merged = RankAcks(1)
    merged.add(0, KVAcks(saved_steps=[3], written=[A]))
    acks = merged.take()
    assert acks.saved_steps == [3] and acks.written == [A]
    with pytest.raises(ValueError, match="rank 1 out of range"):
        merged.add(1, KVAcks())
    with pytest.raises(ValueError, match="ranks must be >= 1"):
        RankAcks(0)
