"""Environment variables radixrelay reads, all prefixed ``RADIXRELAY_``, in one place.

- ``RADIXRELAY_PROFILE_DIR``: when set, each runtime child process (scheduler, worker) runs under
  cProfile and writes ``<name>.prof`` and a text summary ``<name>.txt`` there when it exits
  normally. For finding where a step's host time goes; profiling slows Python code down.
"""

from __future__ import annotations

import os


def profile_dir() -> str | None:
    return os.environ.get("RADIXRELAY_PROFILE_DIR") or None
