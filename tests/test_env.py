"""``radixrelay.env``: the RADIXRELAY_* knobs parse or fail with a message naming the variable."""

from __future__ import annotations

import pytest

from radixrelay import env


def test_small_extend_rows(monkeypatch) -> None:
    monkeypatch.delenv("RADIXRELAY_SMALL_EXTEND_ROWS", raising=False)
    assert env.small_extend_rows() is None
    monkeypatch.setenv("RADIXRELAY_SMALL_EXTEND_ROWS", "0")
    assert env.small_extend_rows() == 0
    monkeypatch.setenv("RADIXRELAY_SMALL_EXTEND_ROWS", "-3")
    with pytest.raises(ValueError, match="RADIXRELAY_SMALL_EXTEND_ROWS"):
        env.small_extend_rows()


def test_trace_steps(monkeypatch) -> None:
    monkeypatch.setenv("RADIXRELAY_TRACE_STEPS", "4:2")
    assert env.trace_steps() == (4, 2)
    monkeypatch.setenv("RADIXRELAY_TRACE_STEPS", "4")
    with pytest.raises(ValueError, match="START:COUNT"):
        env.trace_steps()


def test_gc_mode(monkeypatch) -> None:
    monkeypatch.delenv("RADIXRELAY_GC", raising=False)
    assert env.gc_mode() == "managed"
    monkeypatch.setenv("RADIXRELAY_GC", "python")
    assert env.gc_mode() == "python"
    monkeypatch.setenv("RADIXRELAY_GC", "off")
    with pytest.raises(ValueError, match="RADIXRELAY_GC"):
        env.gc_mode()


def test_overlap_depth(monkeypatch) -> None:
    monkeypatch.delenv("RADIXRELAY_OVERLAP_DEPTH", raising=False)
    assert env.overlap_depth() == 2
    monkeypatch.setenv("RADIXRELAY_OVERLAP_DEPTH", "3")
    assert env.overlap_depth() == 3
    for bad in ("1", "two"):
        monkeypatch.setenv("RADIXRELAY_OVERLAP_DEPTH", bad)
        with pytest.raises(ValueError, match="RADIXRELAY_OVERLAP_DEPTH"):
            env.overlap_depth()


@pytest.mark.parametrize("name, bad", [
    ("RADIXRELAY_STEP_TIMEOUT_S", "abc"), ("RADIXRELAY_STEP_TIMEOUT_S", "-1"), ("RADIXRELAY_STEP_TIMEOUT_S", "inf"),
    ("RADIXRELAY_GRAMMAR_BUDGET_MS", "0"), ("RADIXRELAY_TRACE_STEPS", "3"), ("RADIXRELAY_SMALL_EXTEND_ROWS", "x"),
    ("RADIXRELAY_OVERLAP_DEPTH", "1"), ("RADIXRELAY_GC", "off"), ("RADIXRELAY_TP_ALLREDUCE", "ring"),
    ("RADIXRELAY_CPU_GEMM", "mkl"),
])
def test_check_all_names_the_malformed_variable(monkeypatch, name, bad) -> None:
    """What the CLI and the launcher run before any process starts: every variable with a format."""
    for var in ("RADIXRELAY_STEP_TIMEOUT_S", "RADIXRELAY_GRAMMAR_BUDGET_MS", "RADIXRELAY_TRACE_STEPS",
                "RADIXRELAY_SMALL_EXTEND_ROWS", "RADIXRELAY_OVERLAP_DEPTH", "RADIXRELAY_GC",
                "RADIXRELAY_TP_ALLREDUCE", "RADIXRELAY_CPU_GEMM"):
        monkeypatch.delenv(var, raising=False)
    env.check_all()
    monkeypatch.setenv("RADIXRELAY_STEP_TIMEOUT_S", "0")          # 0: no step watchdog, valid
    env.check_all()
    monkeypatch.setenv(name, bad)
    with pytest.raises(ValueError, match=f"{name} must be .*got {bad!r}"):
        env.check_all()
