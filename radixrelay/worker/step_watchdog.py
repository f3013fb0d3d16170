"""A worker step that never finishes ends the worker process, so that the runtime fails instead of
hanging.

A rank stuck inside a collective (a peer deadlocked while its process still runs, a device that stopped
answering) blocks the worker's thread for good, and neither its heartbeats (written by another thread)
nor the process's exit tell the launcher. The watchdog's own thread looks at the steps the worker has
started and not finished: one older than ``timeout_s`` calls ``on_hang`` once (the worker logs the step
and exits; the launcher then stops every process and fails the requests in flight).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class StepWatchdog:
    def __init__(self, timeout_s: float, on_hang: Callable[[int, float], None], poll_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if timeout_s <= 0:
            raise ValueError(f"StepWatchdog: timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._on_hang = on_hang
        self._poll_s = min(poll_s, timeout_s / 4)
        self._clock = clock
        self._started: dict[int, float] = {}      # step id -> when it was started, while unfinished
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._fired = False
        self._thread = threading.Thread(target=self._watch, name="step-watchdog", daemon=True)
        self._thread.start()

    def started(self, step_id: int) -> None:
        with self._lock:
            self._started[step_id] = self._clock()

    def finished(self, step_id: int) -> None:
        with self._lock:
            self._started.pop(step_id, None)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._stop.wait(self._poll_s):
            with self._lock:
                oldest = min(self._started.items(), key=lambda item: item[1], default=None)
            if oldest is None or self._fired:
                continue
            step_id, since = oldest
            elapsed = self._clock() - since
            if elapsed > self.timeout_s:
                self._fired = True
                self._on_hang(step_id, elapsed)
