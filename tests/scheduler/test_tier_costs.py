"""``TierCosts``: the measured disk read and prefill rates, and the wait-or-recompute choice."""

from __future__ import annotations

import pytest

from radixrelay.scheduler.tier_costs import PREFILL_MIN_TOKENS, PROBE_EVERY_S, TierCosts


def test_waits_until_both_rates_are_measured():
    costs = TierCosts()
    assert costs.worth_waiting(10_000, 1) and costs.read_pages_per_s is None
    costs.step(PREFILL_MIN_TOKENS, 0.01)
    assert costs.worth_waiting(10_000, 1)                      # the disk not measured yet
    costs.step(PREFILL_MIN_TOKENS - 1, 5.0)                     # a decode-heavy step says nothing
    assert costs.prefill_s_per_token == pytest.approx(0.01 / PREFILL_MIN_TOKENS)


def test_read_rate_counts_only_time_with_reads_in_flight():
    costs = TierCosts()
    costs.reads_sent(10, now=0.0)
    costs.reads_done(10, now=0.5)                               # 10 pages in 0.5 s
    costs.reads_sent(10, now=100.0)                             # 99.5 s idle in between: not counted
    costs.reads_done(10, now=100.5)
    assert costs.read_pages_per_s == pytest.approx(20.0)


def test_recompute_when_the_reads_would_take_longer():
    costs = TierCosts()
    costs.reads_sent(100, now=0.0)
    costs.reads_done(100, now=1.0)                              # 100 pages/s
    costs.step(1000, 0.04)                                      # 40 us a token
    # 50 pages ahead: 0.5 s of reading vs 16 pages x 16 tokens x 40 us = 10 ms of prefill
    assert not costs.worth_waiting(pages_ahead=50, tokens=256)
    # 1 page ahead: 10 ms of reading vs 12,800 tokens x 40 us = 0.5 s of prefill
    assert costs.worth_waiting(pages_ahead=1, tokens=12_800)


def test_rates_follow_a_change():
    costs = TierCosts()
    costs.reads_sent(100, now=0.0)
    costs.reads_done(100, now=1.0)                              # 100 pages/s
    t = 10.0
    for _ in range(60):                                         # then the disk slows to 10 pages/s
        costs.reads_sent(10, now=t)
        costs.reads_done(10, now=t + 1.0)
        t += 10.0
    assert costs.read_pages_per_s == pytest.approx(10.0, rel=0.05)


def test_reading_ahead_stops_when_it_does_not_pay_but_probes_the_disk():
    costs = TierCosts()
    costs.reads_sent(100, now=0.0)
    costs.reads_done(100, now=10.0)                             # 10 pages/s: a slow disk
    costs.step(1000, 0.01)                                      # 10 us a token
    costs.reads_sent(1, now=10.0)                               # the latest read sent at t = 10
    # 16 pages (256 tokens): 1.6 s of reading vs 2.6 ms of prefill: no read ahead ...
    assert not costs.worth_reading(16, 256, now=11.0) and costs.reads_skipped == 1
    # ... until a probe is due (PROBE_EVERY_S after the latest read was sent)
    assert costs.worth_reading(16, 256, now=10.0 + PROBE_EVERY_S)
    assert costs.worth_reading(1, 100_000, now=11.0)            # a long run behind a short queue pays
