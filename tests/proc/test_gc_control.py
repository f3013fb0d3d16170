"""``GcControl``: the start-up heap frozen, automatic full collections off, cyclic garbage still freed
when the process is idle (or once FULL_EVERY_S has passed), every pause timed."""

from __future__ import annotations

import gc
import logging
import weakref

import pytest

from radixrelay.proc import gc_control
from radixrelay.proc.gc_control import GcControl

logger = logging.getLogger("test.gc")


class _Node:
    def __init__(self) -> None:
        self.parent: _Node | None = None
        self.children: list[_Node] = []


def _cycle() -> weakref.ref:
    """A parent <-> child cycle no one references: only the cyclic collector frees it."""
    root, child = _Node(), _Node()
    root.children.append(child)
    child.parent = root
    return weakref.ref(root)


def _old_garbage() -> weakref.ref:
    """A cycle that lived through the young collections (promoted to the oldest generation) and
    became garbage there: what a full collection exists for."""
    holder = [_Node()]
    holder[0].children.append(_Node())
    holder[0].children[0].parent = holder[0]
    gc.collect(1)                                    # still referenced: promoted to generation 2
    ref = weakref.ref(holder[0])
    holder.clear()
    for _ in range(5):
        gc.collect(1)                                # young collections do not look at generation 2
    assert ref() is not None
    return ref


@pytest.fixture
def restore_gc():
    """The test process's collector as it was: thresholds, no frozen objects, no callbacks of ours."""
    thresholds, callbacks = gc.get_threshold(), list(gc.callbacks)
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)
    gc.callbacks[:] = callbacks


def test_settle_freezes_and_defers_full_collections(restore_gc) -> None:
    control = GcControl("test", "managed", logger)
    control.settle()
    # frozen objects are only ever freed (a thread of an earlier test that ends frees its own), never
    # added: the count settle recorded is the one it froze, at least today's
    assert control.stats().frozen >= gc.get_freeze_count() > 0
    assert gc.get_threshold()[2] >= 1 << 30          # young collections never trigger a full one
    full_before = gc.get_stats()[2]["collections"]
    for _ in range(20):                              # many young collections, no full one
        [_cycle() for _ in range(2000)]
    assert gc.get_stats()[2]["collections"] == full_before


def test_idle_poll_frees_cycles_that_survived_the_young_generations(restore_gc, monkeypatch) -> None:
    control = GcControl("test", "managed", logger)
    control.settle()
    ref = _old_garbage()
    assert not control.poll(idle=False)              # busy and FULL_EVERY_S not passed: no pause
    assert ref() is not None
    monkeypatch.setattr(gc_control, "FULL_AFTER_PROMOTIONS", 1)
    assert control.poll(idle=True)
    assert ref() is None
    stats = control.stats()
    assert stats.full_collections >= 1 and stats.collections >= stats.full_collections
    assert stats.seconds > 0 and 0 < stats.longest_s <= stats.seconds


def test_busy_process_still_collects_after_full_every_s(restore_gc, monkeypatch) -> None:
    control = GcControl("test", "managed", logger)
    control.settle()
    ref = _old_garbage()
    monkeypatch.setattr(gc_control, "FULL_EVERY_S", 0.0)
    assert control.poll(idle=False)
    assert ref() is None


def test_idle_poll_waits_for_promotions(restore_gc) -> None:
    control = GcControl("test", "managed", logger)
    control.settle()
    assert not control.poll(idle=True)               # nothing promoted since settle: no full collection


def test_python_mode_keeps_the_interpreter_policy(restore_gc) -> None:
    thresholds = gc.get_threshold()
    control = GcControl("test", "python", logger)
    control.settle()
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == thresholds
    assert control.stats().frozen == 0
    assert not control.poll(idle=True)
    gc.collect()
    assert control.stats().collections >= 1          # this one, timed (settle's own is not)


def test_own_full_every_s(restore_gc) -> None:
    control = GcControl("frontend", "managed", logger, full_every_s=0.0)
    control.settle()
    ref = _old_garbage()
    assert control.poll(idle=False)                  # busy, but its own bound has passed
    assert ref() is None


def test_long_pause_is_logged(restore_gc, monkeypatch, caplog) -> None:
    monkeypatch.setattr(gc_control, "WARN_S", 0.0)
    control = GcControl("test", "python", logger)
    control.install()
    with caplog.at_level(logging.WARNING, logger="test.gc"):
        gc.collect()
    assert "garbage collection of generation 2 paused the process" in caplog.text
    control.uninstall()
    assert control._callback not in gc.callbacks


def test_idle_collection_is_not_a_warning(restore_gc, monkeypatch, caplog) -> None:
    monkeypatch.setattr(gc_control, "WARN_S", 0.0)
    monkeypatch.setattr(gc_control, "FULL_AFTER_PROMOTIONS", 0)
    control = GcControl("test", "managed", logger)
    with caplog.at_level(logging.DEBUG, logger="test.gc"):
        control.settle()
        assert control.poll(idle=True)
    pauses = [r for r in caplog.records if "paused the process" in r.getMessage()]
    assert pauses and all(r.levelno == logging.DEBUG for r in pauses)   # settle's collect is not timed


def test_bad_mode() -> None:
    with pytest.raises(ValueError, match="managed"):
        GcControl("test", "sometimes", logger)


def test_bad_env_fails_in_the_parent_before_any_child(monkeypatch) -> None:
    from radixrelay.config import EngineConfig
    from radixrelay.runtime.launcher import RuntimeProcesses

    monkeypatch.setenv("RADIXRELAY_GC", "never")
    processes = RuntimeProcesses(EngineConfig())
    try:
        with pytest.raises(ValueError, match="RADIXRELAY_GC"):
            processes.spawn()
        assert processes.children == {}
    finally:
        processes.stop()
