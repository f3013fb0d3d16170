"""The garbage collector in the runtime's processes: the start-up heap frozen out of it, full
collections moved to idle moments, every pause timed.

CPython's cyclic collector stops the process for a time proportional to the objects it scans. A
full (generation 2) collection scans every tracked object: in the worker the model's modules and
tensors and its CUDA graphs, in the scheduler the radix tree and every queued request, in the
frontend every open HTTP stream. Left to the interpreter, one fires every few
seconds under load, at whatever allocation crosses the threshold, and the step being planned or
launched waits for it: a stall of tens of milliseconds with the device idle.

``GcControl`` (``RADIXRELAY_GC``, see ``radixrelay.env``):

- ``managed`` (the default): once start-up is done, ``settle()`` collects and freezes the heap
  (``gc.freeze``: those objects are never scanned again) and turns off automatic full collections;
  the young generations are still collected as usual (cheap: they hold only recent objects). The
  process calls ``poll(idle)`` between steps (the frontend from a timer): a full collection runs when
  it is idle and the young collections have promoted ``FULL_AFTER_PROMOTIONS`` batches since the last
  one, or, idle or not, once ``full_every_s`` has passed (a server that is never idle still frees
  its cyclic garbage, with one pause that often). Freezing alone would not do: the interpreter starts
  a full collection when the objects promoted since the last one exceed a quarter of the old
  generation, and with the start-up heap frozen that quarter is small, so full collections of the
  live heap (every queued and running request) would come more often, not less.
- ``python``: the interpreter's own policy (for comparison); pauses are still timed.

Under the interpreter's policy, a server at saturation pauses its frontend, scheduler and worker
for full collections of their live heaps many times a run; managed, a few pauses remain
(benchmarks/results/HISTORY.md has the measurements).

Either way each collection is timed (``gc.callbacks``): total seconds, full collections and the
longest pause, reported as ``GcStats`` and exported by ``/metrics``; a pause longer than
``WARN_S`` is logged (as a warning unless it is a collection this module ran while idle).
"""

from __future__ import annotations

import gc
import logging
import time

from radixrelay.protocol.stats import GcStats

WARN_S = 0.05                 # a pause at least this long is logged (warning)
FULL_AFTER_PROMOTIONS = 100   # managed: an idle process collects fully once this many generation-1
                              # collections ran since the last full one ...
FULL_EVERY_S = 300.0          # ... and a busy one once this long has passed (the default)
FRONTEND_FULL_EVERY_S = 60.0  # the frontend's: its garbage grows with requests served (HTTP, asyncio)
FRONTEND_POLL_S = 0.25        # the frontend polls from a timer this often
_NO_AUTO_FULL = 1 << 30       # threshold2 that the young collections never reach


class GcControl:
    def __init__(self, process: str, mode: str, logger: logging.Logger,
                 full_every_s: float | None = None) -> None:
        if mode not in ("managed", "python"):
            raise ValueError(f"garbage collection mode must be 'managed' or 'python', got {mode!r}")
        self.process, self.mode, self.logger = process, mode, logger
        self.full_every_s = full_every_s       # None: FULL_EVERY_S
        self._seconds = 0.0
        self._collections = self._full = 0
        self._longest = 0.0
        self._frozen = 0
        self._started: float | None = None
        self._generation = 0
        self._last_full = time.monotonic()
        self._gen1_at_last_full = 0
        self._installed = False
        self._idle_collection = False   # a full collection run by poll(idle=True): not worth a warning

    @property
    def managed(self) -> bool:
        return self.mode == "managed"

    def install(self) -> None:
        """Start timing collections (idempotent)."""
        if not self._installed:
            gc.callbacks.append(self._callback)
            self._installed = True

    def uninstall(self) -> None:
        if self._installed:
            gc.callbacks.remove(self._callback)
            self._installed = False

    def settle(self) -> None:
        """Start-up is done: collect, then (managed) freeze what is left and stop automatic full
        collections. Call once, after the process built its long-lived state."""
        gc.collect()                   # start-up garbage: not a pause anyone waits for, not timed
        self.install()
        if not self.managed:
            return
        gc.freeze()
        self._frozen = gc.get_freeze_count()
        t0, t1, _ = gc.get_threshold()
        gc.set_threshold(t0, t1, _NO_AUTO_FULL)
        self._last_full = time.monotonic()
        self._gen1_at_last_full = gc.get_stats()[1]["collections"]
        self.logger.info("%s: %d start-up objects frozen out of the garbage collector; full collections "
                         "when idle", self.process, self._frozen)

    def poll(self, idle: bool) -> bool:
        """Between steps (``idle``: nothing to do for now): run a full collection if one is due
        (managed only). True if one ran."""
        if not self.managed:
            return False
        elapsed = time.monotonic() - self._last_full
        if elapsed < (FULL_EVERY_S if self.full_every_s is None else self.full_every_s):
            if not idle or gc.get_stats()[1]["collections"] - self._gen1_at_last_full < FULL_AFTER_PROMOTIONS:
                return False
        self.collect_full(idle)
        return True

    def collect_full(self, idle: bool = False) -> None:
        self._idle_collection = idle
        try:
            gc.collect(2)
        finally:
            self._idle_collection = False
        self._last_full = time.monotonic()
        self._gen1_at_last_full = gc.get_stats()[1]["collections"]

    def stats(self) -> GcStats:
        return GcStats(self._seconds, self._collections, self._full, self._longest, self._frozen)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            self._generation = info.get("generation", 0)
            return
        if self._started is None:
            return
        pause = time.perf_counter() - self._started
        self._started = None
        self._seconds += pause
        self._collections += 1
        self._full += self._generation == 2
        self._longest = max(self._longest, pause)
        if pause >= WARN_S:
            level = logging.DEBUG if self._idle_collection else logging.WARNING
            self.logger.log(level, "%s: garbage collection of generation %d paused the process %.0f ms "
                            "(%d objects collected)", self.process, self._generation, pause * 1e3,
                            info.get("collected", 0))

