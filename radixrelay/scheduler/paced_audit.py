"""The KV audit as the scheduler process serves it (``StatsReply``, ``/metrics``): the holder counts on every
call, ``check_integrity`` paced (``radixrelay.scheduler.audit`` says why and what the counts mean)."""

from __future__ import annotations

import msgspec

from radixrelay.protocol.stats import KVAudit
from radixrelay.scheduler.scheduler import Scheduler


class PacedAudit:
    """``Scheduler.audit`` with ``check_integrity`` paced: run on every call while the scheduler has no
    work, at most every ``every_s`` seconds while it has; in between the last verdict is reported with
    its age."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self._at = float("-inf")              # when check_integrity last ran ...
        self._error: str | None = None        # ... and its verdict

    def audit(self, scheduler: Scheduler, now: float) -> KVAudit:
        """``now``: a monotonic clock reading, seconds."""
        due = not scheduler.has_work() or now - self._at >= self.every_s
        audit = scheduler.audit(integrity=due)
        if due:
            self._at, self._error = now, audit.integrity_error
            return audit
        return msgspec.structs.replace(audit, integrity_error=self._error, integrity_age_s=now - self._at)
