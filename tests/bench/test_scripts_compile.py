"""Every benchmark script under ``benchmarks/`` (its subject folders included) at least compiles, and
none edits ``sys.path`` (they run as modules: ``python -m benchmarks.<subject>.<script>``): most run only
on the GPU machine, where a syntax error would cost a device session to find."""

from __future__ import annotations

import py_compile
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[2] / "benchmarks").rglob("*.py"))


def test_there_are_scripts() -> None:
    assert len(SCRIPTS) > 10


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: "/".join(p.parts[-2:]))
def test_compiles(script: Path, tmp_path: Path) -> None:
    py_compile.compile(str(script), cfile=str(tmp_path / "x.pyc"), doraise=True)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: "/".join(p.parts[-2:]))
def test_no_path_edits(script: Path) -> None:
    assert "sys.path" not in script.read_text(), "run it as a module instead"
