"""``StepWatchdog``: a step left unfinished past the timeout calls ``on_hang`` once; finished steps never do."""

from __future__ import annotations

import threading
import time

import pytest

from radixrelay.env import step_timeout_s
from radixrelay.worker.step_watchdog import StepWatchdog


def test_a_step_past_the_timeout_fires_once():
    fired: list[tuple[int, float]] = []
    done = threading.Event()

    def on_hang(step_id: int, elapsed: float) -> None:
        fired.append((step_id, elapsed))
        done.set()

    dog = StepWatchdog(0.2, on_hang, poll_s=0.02)
    dog.started(1)
    dog.started(2)
    dog.finished(1)
    assert done.wait(3)
    time.sleep(0.1)
    dog.stop()
    assert len(fired) == 1 and fired[0][0] == 2 and fired[0][1] > 0.2


def test_steps_finished_in_time_never_fire():
    fired = []
    dog = StepWatchdog(0.3, lambda *a: fired.append(a), poll_s=0.02)
    for step in range(20):
        dog.started(step)
        time.sleep(0.02)
        dog.finished(step)
    time.sleep(0.4)
    dog.stop()
    assert fired == []


def test_timeout_setting(monkeypatch):
    monkeypatch.delenv("RADIXRELAY_STEP_TIMEOUT_S", raising=False)
    assert step_timeout_s() == 120.0
    monkeypatch.setenv("RADIXRELAY_STEP_TIMEOUT_S", "0")
    assert step_timeout_s() == 0.0
    for bad in ("-1", "soon", "inf", "nan"):
        monkeypatch.setenv("RADIXRELAY_STEP_TIMEOUT_S", bad)
        with pytest.raises(ValueError, match="RADIXRELAY_STEP_TIMEOUT_S"):
            step_timeout_s()
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        StepWatchdog(0, lambda *a: None)
