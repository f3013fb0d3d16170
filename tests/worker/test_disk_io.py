"""``DiskIO``: the pool of disk threads behind the KV tiers. Jobs of different pages run in parallel,
reads go before a backlog of writes, and a page's own jobs never overtake each other."""

from __future__ import annotations

import threading
import time

import pytest

from radixrelay.worker.kv_tiers import DiskIO


def _job(log: list, hold: threading.Event | None = None, sleep: float = 0.0):
    def fn(job, key, *args):
        log.append(("start", job.kind, key))
        if hold is not None:
            assert hold.wait(5)
        time.sleep(sleep)
        log.append(("end", job.kind, key))
        return job.kind, key, True
    return fn


def _settle(io: DiskIO, jobs) -> None:
    for job in jobs:
        assert io.settle(job, wait=True) and job.result[2]


def test_reads_overtake_queued_writes():
    log: list = []
    hold = threading.Event()
    io = DiskIO(5.0, threads=1)
    first = io.submit(_job(log, hold), "write", b"a")
    time.sleep(0.05)                                     # the one thread is busy with it
    jobs = [first] + [io.submit(_job(log), "write", k) for k in (b"b", b"c")]
    jobs.append(io.submit(_job(log), "read", b"d"))
    hold.set()
    _settle(io, jobs)
    starts = [key for what, _, key in log if what == "start"]
    assert starts == [b"a", b"d", b"b", b"c"]
    io.close([])


def test_a_pages_jobs_run_in_order_even_with_idle_threads():
    log: list = []
    io = DiskIO(5.0, threads=4)
    jobs = [io.submit(_job(log, sleep=0.1), "write", b"k"), io.submit(_job(log), "read", b"k"),
            io.submit(_job(log), "delete", b"k")]
    _settle(io, jobs)
    assert [(what, kind) for what, kind, _ in log] == [("start", "write"), ("end", "write"), ("start", "read"),
                                                       ("end", "read"), ("start", "delete"), ("end", "delete")]
    io.close([])


def test_jobs_of_different_pages_run_in_parallel():
    log: list = []
    io = DiskIO(5.0, threads=4)
    start = time.monotonic()
    jobs = [io.submit(_job(log, sleep=0.3), "read", bytes([i]) * 16) for i in range(4)]
    _settle(io, jobs)
    assert time.monotonic() - start < 0.9                # one after another would take 1.2 s
    io.close([])


def test_a_given_up_job_lets_its_pages_next_job_run():
    log: list = []
    hold = threading.Event()
    io = DiskIO(0.2, threads=2)
    stuck = io.submit(_job(log, hold), "read", b"s")
    after = io.submit(_job(log), "read", b"s")
    assert io.settle(stuck, wait=True) and stuck.result == ("read", b"s", False)
    assert io.settle(after, wait=True) and after.result == ("read", b"s", True)
    assert io.abandoned == 1
    hold.set()
    io.close([])


def test_bad_pool_settings_are_refused():
    with pytest.raises(ValueError, match="threads must be >= 1"):
        DiskIO(1.0, threads=0)
    with pytest.raises(ValueError, match="deadline_s must be > 0"):
        DiskIO(0.0)
