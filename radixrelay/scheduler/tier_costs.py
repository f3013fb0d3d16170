"""Wait for a disk read, or recompute? The measured rates behind that choice.

A queued request whose history is being read from disk into host memory can wait for the reads and
then load its history, or be admitted now and compute the pages not yet read (the reads still land
in host memory, for later). Waiting pays off only while the reads finish sooner than the prefill of
those tokens would take, so both rates are measured while serving:

- disk reads: pages acknowledged per second of time during which reads were in flight (the I/O pool
  reads several pages at once: a throughput, not a latency), decayed so the estimate follows the disk;
- prefill: device seconds per token of steps whose extend rows are mostly prefill (at least
  ``PREFILL_MIN_TOKENS`` tokens), decayed the same way.

Until both have been measured, a request waits (the tier's behaviour without a cost model).
"""

from __future__ import annotations

# Steps with fewer extend tokens say more about decode than about prefill: not counted.
PREFILL_MIN_TOKENS = 256
# Weight of the past in each estimate (per update): the rates follow the device and the disk within
# a few dozen updates.
DECAY = 0.9
# While reading ahead does not pay, one read ahead is still allowed this often, so that the disk's rate
# stays measured (it may recover: a page cache warming up, another tenant's I/O ending).
PROBE_EVERY_S = 5.0


class TierCosts:
    def __init__(self) -> None:
        self._read_pages = 0.0            # decayed pages read ...
        self._read_busy_s = 0.0           # ... over decayed seconds with reads in flight
        self._busy_since_done = 0.0       # seconds with reads in flight since the last acknowledgement
        self._in_flight = 0
        self._since: float | None = None  # when the current stretch of reads in flight was last counted
        self._prefill_tokens = 0.0        # decayed extend tokens ...
        self._prefill_s = 0.0             # ... over decayed device seconds of their steps
        self._last_sent: float | None = None
        self.recomputed_instead = 0       # admissions that did not wait for their reads
        self.reads_skipped = 0            # runs on disk not read ahead: computing them is cheaper

    # -- measurements ------------------------------------------------------------------------------

    def reads_sent(self, pages: int, now: float) -> None:
        """``pages`` disk reads were handed to the worker at ``now`` (monotonic seconds)."""
        if pages <= 0:
            return
        self._count_busy(now)
        self._in_flight += pages
        self._last_sent = now

    def reads_done(self, pages: int, now: float) -> None:
        """``pages`` reads (hits or misses) were acknowledged at ``now``."""
        if pages <= 0:
            return
        self._count_busy(now)
        self._in_flight = max(0, self._in_flight - pages)
        self._read_pages = DECAY * self._read_pages + pages
        self._read_busy_s = DECAY * self._read_busy_s + self._busy_since_done
        self._busy_since_done = 0.0

    def _count_busy(self, now: float) -> None:
        if self._in_flight and self._since is not None:
            self._busy_since_done += max(0.0, now - self._since)
        self._since = now

    def step(self, extend_tokens: int, device_s: float) -> None:
        """A finished step's extend tokens and device seconds."""
        if extend_tokens < PREFILL_MIN_TOKENS or device_s <= 0:
            return
        self._prefill_tokens = DECAY * self._prefill_tokens + extend_tokens
        self._prefill_s = DECAY * self._prefill_s + device_s

    # -- estimates ---------------------------------------------------------------------------------

    @property
    def read_pages_per_s(self) -> float | None:
        """Pages the disk tier reads per second while it reads (None: not measured yet)."""
        if self._read_pages <= 0 or self._read_busy_s <= 0:
            return None
        return self._read_pages / self._read_busy_s

    @property
    def prefill_s_per_token(self) -> float | None:
        if self._prefill_tokens <= 0:
            return None
        return self._prefill_s / self._prefill_tokens

    def worth_reading(self, pages_ahead: int, tokens: int, now: float) -> bool:
        """Whether to read a run ahead (``worth_waiting``), or a probe of the disk is due anyway."""
        if self.worth_waiting(pages_ahead, tokens):
            return True
        if self._last_sent is None or now - self._last_sent >= PROBE_EVERY_S:
            return True
        self.reads_skipped += 1
        return False

    def worth_waiting(self, pages_ahead: int, tokens: int) -> bool:
        """Whether waiting for ``pages_ahead`` reads (the request's, and those queued before them) is
        cheaper than computing ``tokens`` prompt tokens."""
        rate, per_token = self.read_pages_per_s, self.prefill_s_per_token
        if rate is None or per_token is None:
            return True
        return pages_ahead / rate <= tokens * per_token
