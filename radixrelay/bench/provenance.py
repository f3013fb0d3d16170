"""Which source a benchmark measured: the commit of the tree it ran from, marked when the tree differs.

A results file names a commit; a copy of the working tree (another machine, a checkout with edits not
yet committed) can carry a ``.git`` whose HEAD is not what ran. ``source_commit`` then says so instead
of naming a commit that did not run.
"""

from __future__ import annotations

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
