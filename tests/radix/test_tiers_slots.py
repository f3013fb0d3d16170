"""Host-slot layout of the KV tiers' saves: a step's saves take consecutive host slots, also once host
memory is full and every save evicts, because the worker moves a run of consecutive slots as one block
per layer and K/V and pays a copy per layer and K/V for every further piece."""

from __future__ import annotations

from radixrelay.protocol.kv import KVAcks
from radixrelay.radix.tiers import KVTiers


def _pieces(slots: list[int]) -> int:
    slots = sorted(slots)
    return 1 + sum(b != a + 1 for a, b in zip(slots, slots[1:]))


def _run(host_pages: int, per_step: int, own: int, lag: int, steps: int) -> list[int]:
    """Each step ``per_step`` requests leave, each saving a shared 8-page prefix and ``own`` pages of its
    own; saves are acknowledged ``lag`` steps later. Returns the slot pieces of each step's saves."""
    tiers = KVTiers(host_pages, policy="scheduler")
    prefix = [b"p%d" % i for i in range(8)]
    pieces, rid = [], 0
    for step in range(steps):
        for _ in range(per_step):
            rid += 1
            keys = prefix + [b"r%d.%d" % (rid, j) for j in range(own)]
            tiers.save(keys, list(range(len(keys))))
        out = tiers.take(step)
        pieces.append(_pieces([slot for _, slot in out.saves]))
        if step >= lag:
            tiers.on_acks(KVAcks([step - lag], [], [], [], [], [], 0.0, 0.0))
        tiers.check_integrity()
    return pieces


def test_saves_stay_in_one_slot_run_once_host_memory_is_full():
    for lag in (0, 2):
        pieces = _run(host_pages=203, per_step=4, own=12, lag=lag, steps=60)
        # full after ~4 steps; evicting only the shortage left 6-8 pieces a step (out of phase with the
        # saves). Now each save is one run; a step's saves span two where they wrap around the slots.
        steady = pieces[10:]
        assert max(steady) <= 2 and sum(steady) / len(steady) < 1.5, (lag, pieces)


def test_eviction_stops_once_one_run_holds_the_save():
    tiers = KVTiers(40, policy="lru")
    for rid in range(5):                     # 5 chains of 8 pages: full
        tiers.save([b"r%d.%d" % (rid, j) for j in range(8)], list(range(8)))
        tiers.on_acks(KVAcks([rid], [], [], [], [], [], 0.0, 0.0)) if tiers.take(rid) else None
    assert tiers.num_free_slots == 0
    tiers.save([b"new.%d" % j for j in range(8)], list(range(8)))
    # the oldest chain's 8 slots were one run: nothing else evicted
    assert tiers.counters.host_evicted == 8 and tiers.num_host_entries == 40
    tiers.check_integrity()
