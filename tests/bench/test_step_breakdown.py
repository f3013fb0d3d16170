"""``bench_serving_gpu.step_breakdown``: counter deltas of one serving run, and the device-busy fraction
over the traffic's own window (not the client processes' start-up around it)."""

from __future__ import annotations

import pytest

from benchmarks.serving.bench_serving_gpu import step_breakdown


def test_device_busy_is_over_the_traffic_window() -> None:
    before = {"radixrelay_steps_total": 100.0, "radixrelay_worker_device_seconds_total": 5.0,
              "radixrelay_worker_launch_seconds_total": 1.0}
    after = {"radixrelay_steps_total": 300.0, "radixrelay_worker_device_seconds_total": 23.0,
             "radixrelay_worker_launch_seconds_total": 1.4}
    st = step_breakdown(before, after, wall_s=23.0, traffic_s=20.0)
    assert st["steps"] == 200
    assert st["device_busy"] == pytest.approx(18.0 / 20.0)     # not 18 / 23: start-up is not traffic
    assert (st["wall_s"], st["traffic_s"]) == (23.0, 20.0)
    assert st["launch_ms_per_step"] == pytest.approx(2.0)


def test_without_a_traffic_window_the_wall_time_counts() -> None:
    st = step_breakdown({}, {"radixrelay_worker_device_seconds_total": 3.0}, wall_s=4.0)
    assert st["device_busy"] == pytest.approx(0.75)
    assert st["launch_ms_per_step"] is None                   # no steps counter: no per-step figure


def test_decode_only_steps_get_their_own_launch_figure() -> None:
    before = {"radixrelay_steps_total": 0.0, "radixrelay_worker_launch_seconds_total": 0.0,
              "radixrelay_decode_only_steps_total": 0.0, "radixrelay_decode_only_rows_total": 0.0,
              "radixrelay_worker_decode_only_launch_seconds_total": 0.0}
    after = {"radixrelay_steps_total": 100.0, "radixrelay_worker_launch_seconds_total": 0.5,
             "radixrelay_decode_only_steps_total": 80.0, "radixrelay_decode_only_rows_total": 80.0 * 256,
             "radixrelay_worker_decode_only_launch_seconds_total": 0.08}
    st = step_breakdown(before, after, wall_s=10.0)
    assert st["launch_ms_per_step"] == pytest.approx(5.0)           # mixed steps included
    assert st["decode_only_steps"] == 80
    assert st["launch_ms_per_decode_step"] == pytest.approx(1.0)    # decode-only steps alone
    assert st["decode_only_batch"] == pytest.approx(256)


def test_a_server_without_decode_only_counters_reports_none() -> None:
    st = step_breakdown({}, {"radixrelay_steps_total": 10.0}, wall_s=1.0)
    assert st["launch_ms_per_decode_step"] is None and st["decode_only_batch"] is None


def test_each_ranks_busy_fraction_and_compilations_after_ready() -> None:
    before = {"radixrelay_worker_rank0_device_seconds_total": 1.0,
              "radixrelay_worker_rank1_device_seconds_total": 1.0}
    after = {"radixrelay_worker_rank0_device_seconds_total": 10.0,
             "radixrelay_worker_rank1_device_seconds_total": 8.0,
             "radixrelay_jit_compilations_after_ready": 2.0}
    st = step_breakdown(before, after, wall_s=12.0, traffic_s=10.0)
    assert st["rank_busy"] == [pytest.approx(0.9), pytest.approx(0.7)]     # in rank order
    assert st["jit_after_ready"] == 2
