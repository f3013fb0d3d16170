"""``source_commit``: the tree's HEAD, marked when a tracked file differs from it."""

from __future__ import annotations

import subprocess

from radixrelay.bench.provenance import source_commit


def _git(root, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout.strip()


def test_source_commit(tmp_path) -> None:
    assert source_commit(tmp_path) == "unknown"                 # not a repository
    _git(tmp_path, "init", "-q")
    assert source_commit(tmp_path) == "unknown"                 # no commit yet
    (tmp_path / "a.py").write_text("x = 1\n")
    _git(tmp_path, "add", "a.py")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = _git(tmp_path, "rev-parse", "--short", "HEAD")
    assert source_commit(tmp_path) == head
    (tmp_path / "new.txt").write_text("untracked files do not count\n")
    assert source_commit(tmp_path) == head
    (tmp_path / "a.py").write_text("x = 2\n")                   # what runs is not HEAD
    assert source_commit(tmp_path) == head + "+modified"


def test_results_files_are_named_after_the_device(tmp_path) -> None:
    from radixrelay.bench.provenance import device_slug, write_device_results

    assert device_slug("NVIDIA H100 80GB HBM3") == "h100_80gb_hbm3"
    assert device_slug("NVIDIA H200") == "h200"
    assert device_slug("NVIDIA H100 PCIe (MIG 1g.10gb)") == "h100_pcie_mig_1g_10gb"
    path = write_device_results(tmp_path / "out", "engine", "NVIDIA H200", ["# a", "| b |"])
    assert path == str(tmp_path / "out" / "engine_h200.md")
    assert (tmp_path / "out" / "engine_h200.md").read_text() == "# a\n| b |\n"
