"""The paced KV audit of the scheduler process (``radixrelay.scheduler.paced_audit``)."""

from __future__ import annotations

from radixrelay.scheduler.paced_audit import PacedAudit
from radixrelay.sampling_params import SamplingParams
from tests.scheduler.test_audit import make


def test_paced_audit_checks_integrity_at_idle_and_every_so_often_under_load(monkeypatch):
    """``PacedAudit`` (the /metrics path): at idle check_integrity runs on every audit; with requests live
    at most once per interval, scrapes in between reporting its last verdict and that verdict's age."""
    sched, worker = make()
    paced = PacedAudit(every_s=30.0)
    calls = []
    real = sched.check_integrity

    def counted():
        calls.append(1)
        real()

    monkeypatch.setattr(sched, "check_integrity", counted)
    paced.audit(sched, now=0.0)
    paced.audit(sched, now=1.0)
    assert len(calls) == 2                                  # idle: every time
    sched.add_request(1, list(range(30)), SamplingParams(max_tokens=20))
    sched.process_output(worker.step(sched.schedule()))
    assert sched.has_work()
    soon = paced.audit(sched, now=2.0)                      # checked 1 s ago (idle): not due
    assert len(calls) == 2 and soon.integrity_age_s == 1.0 and soon.integrity_ok
    first = paced.audit(sched, now=31.0)                    # 30 s since the last check: due
    later = paced.audit(sched, now=39.0)
    assert len(calls) == 3 and first.integrity_age_s == 0.0 and later.integrity_age_s == 8.0
    assert later.integrity_ok and later.live_requests == 1   # the holder counts are fresh
    # a failure found by a check is reported until the next check
    monkeypatch.setattr(sched, "check_integrity", lambda: (_ for _ in ()).throw(AssertionError("leak")))
    assert paced.audit(sched, now=61.0).integrity_error == "leak"
    assert paced.audit(sched, now=70.0).integrity_error == "leak"
