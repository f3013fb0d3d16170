"""The soak benchmark as a CI check: 8 s of mixed traffic with client aborts against the real
server (default model), run as a user runs it (``python -m benchmarks.reliability.soak``). Long runs
are the benchmark's job; this one is only as long as the check needs: the aborts are sure to happen
(with the fixed seed, the first two requests of the eight clients include three planned aborts, two of
them streams closed after one or two events), the clients cycle through requests of every kind for
5 s past the warm-up RSS sample, and /metrics is scraped (integrity, RSS) every second.

Asserts what the hardening issue asks of a soak: no request lost (every request sent completed,
failed with a reason or was aborted by the client on purpose), none failed, the server back at its
idle baseline afterwards (no KV page held for a request, no radix lock; from /metrics),
check_integrity passing at every scrape, RSS growth of each process bounded, and a clean SIGTERM
shutdown. The server runs with one torch thread (see tests/runtime/test_faults.py for why).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DURATION_S = 8
WARMUP_S = 3
# A short CPU run: the worker's RSS moves by a few % at most as new batch shapes appear (torch's
# allocator caches); a leak proportional to requests would show well beyond this.
RSS_GROWTH_LIMIT = 0.15

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def test_soak_8s_with_aborts(tmp_path, short_tmp):
    out = tmp_path / "soak"
    cmd = [sys.executable, "-m", "benchmarks.reliability.soak", "--duration", str(DURATION_S),
           "--warmup", str(WARMUP_S), "--abort-share", "0.2", "--scrape-interval", "1.0",
           "--max-rss-growth", str(RSS_GROWTH_LIMIT), "--request-timeout", "120",
           "--out", str(out), "--server-log", str(tmp_path / "server.log")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(short_tmp)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert (out.with_suffix(".json")).exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads(out.with_suffix(".json").read_text())["summary"]
    report = out.with_suffix(".md").read_text()
    assert s["sent"] > 0 and s["completed"] > 0, report
    assert s["aborted"] >= 1, report                      # the abort paths were exercised
    assert s["lost"] == 0 and s["failed"] == 0, report
    assert s["sent"] == s["completed"] + s["failed"] + s["aborted"]
    assert s["idle_baseline"]["reached"], report
    m = s["idle_baseline"]["metrics"]
    assert m["radixrelay_kv_request_pages"] == 0 and m["radixrelay_radix_lock_refs"] == 0, report
    assert s["integrity"]["ok"] and s["integrity"]["scrapes"] >= 5, report
    assert set(s["rss"]) == {"server", "scheduler", "worker"}, report
    assert all(g["growth"] is not None and g["growth"] <= RSS_GROWTH_LIMIT for g in s["rss"].values()), report
    assert s["verdict"]["clean_shutdown"], report
    assert proc.returncode == 0, report
    assert not [p for p in short_tmp.iterdir() if p.name.startswith("radixrelay-")]   # sockets removed
