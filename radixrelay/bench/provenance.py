"""Which source and device a benchmark measured: the commit of the tree it ran from, marked when the tree
differs; results files named after the device.

A results file names a commit; a copy of the working tree (another machine, a checkout with edits not
yet committed) can carry a ``.git`` whose HEAD is not what ran. ``source_commit`` then says so instead
of naming a commit that did not run.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path


def source_commit(root: str | Path) -> str:
    """``git rev-parse --short HEAD`` of ``root``, with ``+modified`` when a tracked file differs from
    HEAD; ``unknown`` where there is no git or no repository."""
    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)

    try:
        head = git("rev-parse", "--short", "HEAD")
        if head.returncode != 0 or not head.stdout.strip():
            return "unknown"
        status = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    dirty = status.returncode != 0 or bool(status.stdout.strip())
    return head.stdout.strip() + ("+modified" if dirty else "")


def device_slug(name: str) -> str:
    """A device name as a file-name part: ``NVIDIA H100 80GB HBM3`` -> ``h100_80gb_hbm3``."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower().replace("nvidia ", "")).strip("_")


def write_device_results(out_dir: str | Path, stem: str, device_name: str, lines: list[str]) -> str:
    """Write ``lines`` to ``<out_dir>/<stem>_<device slug>.md`` (the directory made if needed); returns the path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{stem}_{device_slug(device_name)}.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path
