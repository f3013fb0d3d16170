"""Summary figures from hand-made records: exact counts, percentiles, TPOT, goodput, cache ratio."""

from __future__ import annotations

import pytest

from radixrelay.bench.summary import SLO, RequestRecord, stats, summarize


def record(ok=True, ttft=100.0, e2e=500.0, completion=5, prompt=20, cached=10, itl=(100.0,) * 4,
           error=None, source="usage") -> RequestRecord:
    return RequestRecord(session=0, turn=0, label="x", start_s=0.0, ok=ok, error=error, max_tokens=5,
                         prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached,
                         token_source=source, e2e_ms=e2e, ttft_ms=ttft, itl_ms=tuple(itl))


def test_stats_percentiles():
    s = stats([float(v) for v in range(1, 101)])
    assert s["mean"] == 50.5 and s["p50"] == 50.5
    assert s["p90"] == pytest.approx(90.1) and s["p99"] == pytest.approx(99.01)
    assert stats([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_tpot():
    assert record(ttft=100, e2e=500, completion=5).tpot_ms == 100.0
    assert record(completion=1).tpot_ms is None
    assert record(itl=()).tpot_ms is None              # not streamed
    assert record(ok=False).tpot_ms is None


def test_summary():
    records = [record(), record(ttft=300.0, e2e=1100.0, cached=None),
               record(ok=False, error="HTTP 503: draining", ttft=None, completion=0, itl=()),
               record(ok=False, error="HTTP 503: draining", ttft=None, completion=0, itl=())]
    s = summarize(records, duration_s=2.0, slo=SLO())
    assert (s["num_requests"], s["completed"], s["failed"]) == (4, 2, 2)
    assert s["errors"] == {"HTTP 503: draining": 2}
    assert s["request_throughput"] == 1.0
    assert s["total_prompt_tokens"] == 40 and s["total_completion_tokens"] == 10
    assert s["input_token_throughput"] == 20.0 and s["output_token_throughput"] == 5.0
    assert s["total_cached_tokens"] == 10 and s["cache_hit_ratio"] == 0.5   # the request with usage
    assert s["ttft_ms"]["mean"] == 200.0 and s["tpot_ms"]["p50"] == 150.0
    assert s["e2e_ms"]["p50"] == 800.0 and s["itl_ms"]["p99"] == 100.0
    assert "goodput" not in s


def test_goodput():
    records = [record(ttft=100.0, e2e=500.0), record(ttft=300.0, e2e=700.0),
               record(ttft=100.0, e2e=900.0), record(ok=False, ttft=None)]
    s = summarize(records, duration_s=4.0, slo=SLO(ttft_ms=200.0, tpot_ms=150.0))
    assert s["goodput"] == 0.25 and s["slo_attainment"] == 0.25     # only the first meets both
    assert summarize(records, 4.0, SLO(ttft_ms=200.0))["goodput"] == 0.5
