"""Logging that stays bounded whatever the traffic: at most one record per cause per interval.

A flood of bad connections otherwise logs once per connection or worse: uvicorn warns "Invalid HTTP
request received." for each malformed request, and asyncio's accept loop, once descriptors run out,
logs "socket.accept() out of system resource" with a traceback for every accept() it retries (up to the
listen backlog, 2,048, per turn of the event loop). Our own
events (the read deadline, the connection cap) are logged per connection too.

``RateLimitFilter`` passes the first record of each cause in an interval and counts the others; the count
is logged as one summary line when the interval ends (or rides on the cause's next record, whichever
comes first). A cause is the logger and the first line of the message template, so records that differ
only in their arguments (a client address, a socket) are one cause. A record caused by an OSError loses
its traceback (one line: the error's text): a descriptor or connection error's stack says nothing more.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

INTERVAL_S = 10.0
# Loggers whose records can come once per connection: uvicorn's server log, asyncio's (accept() and
# transport errors, through the loop's exception handler; uvloop logs there too), and ours.
LOGGERS = ("uvicorn.error", "asyncio", "radixrelay.net")
_SUMMARY = "radixrelay_log_summary"       # set on our own summary records: never filtered
_MAX_CAUSES = 1024                        # causes remembered; stale ones are dropped past this


@dataclass
class _Window:
    since: float                          # time.monotonic() of the cause's first record in this window
    first: str                            # that record's message, first line: the summary's label
    suppressed: int = 0                   # records dropped in this window and not yet reported


class RateLimitFilter(logging.Filter):
    def __init__(self, interval_s: float = INTERVAL_S) -> None:
        super().__init__()
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self._lock = threading.Lock()     # records come from any thread (asyncio's from the loop's)
        self._windows: dict[tuple[str, str], _Window] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, _SUMMARY, False):
            return True
        key = (record.name, _first_line(record.msg))
        now = time.monotonic()
        with self._lock:
            window = self._windows.get(key)
            if window is not None and now - window.since < self.interval_s:
                window.suppressed += 1
                if window.suppressed == 1:          # one summary per window, when it ends
                    self._summarize_later(record, window, window.since + self.interval_s - now)
                return False
            earlier = 0
            if window is not None:                  # its summary, if still due, comes with this record
                earlier, window.suppressed = window.suppressed, 0
            if len(self._windows) >= _MAX_CAUSES:
                self._windows = {k: w for k, w in self._windows.items() if now - w.since < self.interval_s}
            self._windows[key] = window = _Window(now, "")
        _drop_os_error_traceback(record)
        window.first = _first_line(_message(record))
        if earlier:
            _append(record, f" [{earlier} more like this in the {self.interval_s:g} s before]")
        return True

    def _summarize_later(self, record: logging.LogRecord, window: _Window, delay: float) -> None:
        name, level = record.name, record.levelno

        def summarize() -> None:
            with self._lock:
                count, window.suppressed = window.suppressed, 0
            if count:
                logging.getLogger(name).log(level, "%d more like this in %g s: %s", count, self.interval_s,
                                            window.first, extra={_SUMMARY: True})

        timer = threading.Timer(max(delay, 0.0), summarize)
        timer.daemon = True
        timer.start()


_installed: RateLimitFilter | None = None
_install_lock = threading.Lock()


def limit_logs(interval_s: float = INTERVAL_S) -> RateLimitFilter:
    """Attach one ``RateLimitFilter`` to ``LOGGERS`` (once per process; later calls return the same filter).
    Call it after uvicorn configured its loggers (``uvicorn.Config``), which keeps filters but not handlers."""
    global _installed
    with _install_lock:
        if _installed is None:
            _installed = RateLimitFilter(interval_s)
            for name in LOGGERS:
                logging.getLogger(name).addFilter(_installed)
        return _installed


def _first_line(msg: object) -> str:
    text = msg if isinstance(msg, str) else type(msg).__name__
    return text.split("\n", 1)[0][:200]


def _message(record: logging.LogRecord) -> str:
    try:
        return record.getMessage()
    except Exception:  # noqa: BLE001 - a record whose arguments do not fit its template: its template
        return str(record.msg)


def _append(record: logging.LogRecord, text: str) -> None:
    record.msg = f"{record.msg}{text.replace('%', '%%') if record.args else text}"


def _drop_os_error_traceback(record: logging.LogRecord) -> None:
    """An OSError's record in one line: the message's lines joined, the error's text instead of its stack."""
    exc = record.exc_info[1] if record.exc_info else None
    if not isinstance(exc, OSError):
        return
    record.exc_info, record.exc_text = None, None
    if isinstance(record.msg, str):
        record.msg = "; ".join(line for line in record.msg.splitlines() if line.strip())
    _append(record, f" ({type(exc).__name__}: {exc})")
