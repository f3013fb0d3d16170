"""``AllReduceClock``: timed calls on the CPU; on CUDA a start-up table interpolated per forward."""

from __future__ import annotations

import pytest

from radixrelay.model.parallel import AllReduceClock, TensorParallel
from radixrelay.worker.tp_calibration import row_counts


def test_calibrated_costs_interpolate_and_extrapolate():
    clock = AllReduceClock()
    clock.forward(64, 65)
    assert (clock.seconds, clock.calls) == (0.0, 0)            # nothing counted before calibration
    clock.calibrated([1, 64, 256], [10e-6, 12e-6, 20e-6])
    assert clock.cost(1) == clock.cost(0) == 10e-6
    assert clock.cost(160) == pytest.approx(16e-6)            # halfway between 64 and 256 rows
    assert clock.cost(512) == pytest.approx(40e-6)            # beyond the table: proportional to rows
    clock.forward(160, 65)
    assert clock.seconds == pytest.approx(65 * 16e-6) and clock.calls == 65


def test_timed_clock_counts_each_call_and_bad_tables_are_refused():
    clock = AllReduceClock(timed=True)
    clock.add(0.5)
    clock.add(0.25)
    assert (clock.seconds, clock.calls) == (0.75, 2)
    for rows, seconds in (([], []), ([4, 2], [1.0, 2.0]), ([1, 1], [1.0, 1.0]), ([1, 2], [1.0])):
        with pytest.raises(ValueError, match="ascending distinct row counts"):
            clock.calibrated(rows, seconds)


def test_row_counts_cover_one_to_the_largest_step():
    assert row_counts(2304) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 2304]
    assert row_counts(1) == [1] and row_counts(4) == [1, 2, 4]


def test_a_single_rank_has_a_clock_that_stays_at_zero():
    tp = TensorParallel()
    assert tp.clock.seconds == 0 and tp.clock.calls == 0 and tp == TensorParallel()
