"""The scheduler's timeline (``RADIXRELAY_STEP_LOG``): one line per request arrival, step sent and step
output received, for seeing where a burst's time to first token goes (which step admitted a request, how
many rows each step ran, how long each took on the device).

Lines are tab-separated, the first field the event, the second ``time.monotonic()`` in seconds:

- ``arrive  t  rid  prompt_tokens``
- ``step    t  step_id  decode_rows  extend_requests  extend_tokens  waiting  sampled_extend_rids  pages_sent``
  (the requests whose prompt ends in this step, comma-separated; the page ids the plan carries: its
  admissions' page lists and its page appends, what the worker writes into its page table)
- ``done    t  step_id  worker_busy_s  device_s  launch_s``

Written through a buffer and flushed when the loop stops; the file is truncated when the scheduler starts.
"""

from __future__ import annotations

import time
from typing import TextIO


class StepLog:
    def __init__(self, path: str) -> None:
        self._file: TextIO = open(path, "w", buffering=1 << 20)  # noqa: SIM115 - closed by close()

    def arrive(self, rid: int, prompt_tokens: int) -> None:
        self._file.write(f"arrive\t{time.monotonic():.6f}\t{rid}\t{prompt_tokens}\n")

    def step(self, step_id: int, decode_rows: int, extend_requests: int, extend_tokens: int,
             waiting: int, sampled_rids: list[int], pages_sent: int) -> None:
        self._file.write(f"step\t{time.monotonic():.6f}\t{step_id}\t{decode_rows}\t{extend_requests}\t"
                         f"{extend_tokens}\t{waiting}\t{','.join(map(str, sampled_rids))}\t{pages_sent}\n")

    def done(self, step_id: int, busy_s: float, device_s: float, launch_s: float) -> None:
        self._file.write(f"done\t{time.monotonic():.6f}\t{step_id}\t{busy_s:.6f}\t{device_s:.6f}\t{launch_s:.6f}\n")

    def close(self) -> None:
        self._file.close()
