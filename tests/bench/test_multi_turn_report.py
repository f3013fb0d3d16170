"""Multi-turn figures (the benchmark of KV tiers): TTFT of first, later and long-history turns,
the history hit rate and prompt tokens per TTFT second, from hand-made records, in the JSON, the
summary table and the markdown table; and the long first turns of ``MultiTurn(history_len=N)``."""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest

from radixrelay.bench import report
from radixrelay.bench.http_client import BenchClient, ClientConfig
from radixrelay.bench.summary import SLO, RequestRecord, summarize, turn_summary
from radixrelay.bench.runner import run_sessions, token_counter
from radixrelay.bench.workloads import MultiTurn, estimate_tokens, make_workload


def rec(session: int, turn: int, ttft: float | None, prompt: int, completion: int,
        cached: int | None, ok: bool = True) -> RequestRecord:
    return RequestRecord(session=session, turn=turn, label=f"session-{session}", start_s=0.0, ok=ok,
                         error=None if ok else "HTTP 503: draining", max_tokens=completion,
                         prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached,
                         token_source="usage", e2e_ms=(ttft or 0.0) + 100.0, ttft_ms=ttft,
                         itl_ms=(10.0,) * max(completion - 1, 0))


# session 0: long histories (4100, 4300); session 1: short (1050), then a failed turn, after which
# turn 3's history is unknown. TTFTs: first 100, 200; later 50, 70, 30, 400.
RECORDS = [
    rec(0, 0, 100.0, 4000, 100, 0),
    rec(1, 0, 200.0, 1000, 50, None),
    rec(0, 1, 50.0, 4200, 100, 4096),       # history 4000 + 100 = 4100
    rec(1, 1, 30.0, 1100, 50, 1024),        # history 1000 + 50 = 1050
    rec(0, 2, 70.0, 4400, 100, None),       # history 4300; no cached_tokens reported
    rec(1, 2, None, 1200, 0, None, ok=False),
    rec(1, 3, 400.0, 1300, 50, 0),          # history unknown: its previous turn failed
]


def test_turn_summary_exact_figures():
    m = turn_summary(RECORDS)
    assert m["history_threshold"] == 4096
    assert (m["first_turns"], m["later_turns"], m["long_history_turns"]) == (2, 4, 2)
    assert m["ttft_first_ms"]["p50"] == 150.0 and m["ttft_first_ms"]["p99"] == pytest.approx(199.0)
    assert m["ttft_later_ms"]["mean"] == 137.5 and m["ttft_later_ms"]["p50"] == 60.0
    assert m["ttft_later_ms"]["p99"] == pytest.approx(70.0 + 0.97 * 330.0)
    assert m["ttft_long_history_ms"]["p50"] == 60.0          # s0 t1 and t2 (histories 4100, 4300)
    assert m["ttft_long_history_ms"]["p99"] == pytest.approx(69.8)
    # hit rate: later turns with a known history and cached_tokens: s0 t1 and s1 t1
    assert (m["history_cached_tokens"], m["history_tokens"]) == (4096 + 1024, 4100 + 1050)
    assert m["history_hit_rate"] == (4096 + 1024) / (4100 + 1050)
    # (4200 - 4096) + (1100 - 1024) + (1300 - 0) uncached tokens over 50 + 30 + 400 ms
    assert m["uncached_prompt_tokens_per_ttft_s"] == pytest.approx(1480 / 0.48)
    # all four timed later turns: 4200 + 1100 + 4400 + 1300 over 50 + 30 + 70 + 400 ms
    assert m["prompt_tokens_per_ttft_s"] == pytest.approx(11000 / 0.55)


def test_history_threshold():
    m = turn_summary(RECORDS, history_threshold=4300)
    assert m["long_history_turns"] == 1 and m["ttft_long_history_ms"]["p50"] == 70.0
    m = turn_summary(RECORDS, history_threshold=1050)
    assert m["long_history_turns"] == 3 and m["ttft_long_history_ms"]["p50"] == 50.0
    m = turn_summary(RECORDS, history_threshold=10_000)
    assert m["long_history_turns"] == 0 and m["ttft_long_history_ms"]["p50"] is None
    assert summarize(RECORDS, 1.0, SLO(), history_threshold=1050)["multi_turn"] == \
        turn_summary(RECORDS, 1050)


def test_summary_json_and_tables():
    s = summarize(RECORDS, 2.0, SLO())
    assert s["multi_turn"] == turn_summary(RECORDS)
    assert s["ttft_ms"]["p50"] == 85.0                       # all turns together, as before
    run = report.make_run(2.0, s, RECORDS)
    assert json.loads(json.dumps(run))["summary"]["multi_turn"]["history_hit_rate"] == \
        s["multi_turn"]["history_hit_rate"]
    table = report.summary_table("multi-turn @ 2 req/s", s)
    assert "History hit rate (later turns):     99.4% (5120 / 5150 tok)" in table
    assert "Uncached prompt tok / TTFT second:  3083.3" in table
    assert "Prompt tok / TTFT second:           20000.0" in table
    assert "first turns            2    150.00    150.00" in table
    assert "later turns            4    137.50     60.00" in table
    assert "history>=4096          2     60.00     60.00" in table

    single = summarize([rec(0, 0, 100.0, 20, 5, 10)], 1.0, SLO())
    assert "multi_turn" not in single
    assert "multi-turn" not in report.summary_table("random", single)
    md = report.markdown_table([("tiers", run), ("plain", report.make_run(1.0, single, []))])
    header, rule, tiers, plain = md.splitlines()
    assert "| first TTFT p50 (ms) |" in header and "| history>=4096 TTFT p99 (ms) |" in header
    assert header.count("|") == rule.count("|") == tiers.count("|") == plain.count("|")
    assert tiers.endswith("| 150.00 | 199.00 | 60.00 | 390.10 | 60.00 | 69.80 | 99.4% | 3083.3 |")
    assert plain.endswith("| 50.0% |" + " - |" * 8)
    assert "first TTFT" not in report.markdown_table([("plain", report.make_run(1.0, single, []))])


def test_later_turns_without_figures():
    records = [rec(0, 0, 100.0, 20, 5, None), rec(0, 1, None, 30, 0, None, ok=False)]
    s = summarize(records, 1.0, SLO())
    m = s["multi_turn"]
    assert (m["first_turns"], m["later_turns"], m["long_history_turns"]) == (1, 0, 0)
    assert m["ttft_later_ms"]["p50"] is None and m["history_hit_rate"] is None
    assert m["history_tokens"] is None and m["prompt_tokens_per_ttft_s"] is None
    assert m["uncached_prompt_tokens_per_ttft_s"] is None
    table = report.summary_table("multi-turn", s)
    assert "History hit rate (later turns):     -" in table and "later turns            0" in table
    assert "| - | - |" in report.markdown_table([("x", report.make_run(1.0, s, records))])


def test_history_len_prefixes_the_first_turn_only():
    base = MultiTurn(sessions=3, turns=3, system_len=8, turn_len=5, output_len=2)
    long = MultiTurn(sessions=3, turns=3, system_len=8, turn_len=5, output_len=2, history_len=300)
    assert make_workload("multi-turn", {"history_len": "300", "sessions": "3", "turns": "3",
                                        "system_len": "8", "turn_len": "5", "output_len": "2"}) == long
    sessions = long.generate(9, np.random.default_rng(7))
    assert sessions == long.generate(9, np.random.default_rng(7))
    assert sessions != long.generate(9, np.random.default_rng(8))
    documents = set()
    for s in sessions:
        first, *later = s.turns
        document, question = first.user.split("\n\n")
        assert len(document.split()) == 300 and len(question.split()) == 5
        assert all(len(t.user.split()) == 5 and "\n" not in t.user for t in later)
        documents.add(document)
    assert len(documents) == 3                               # each session its own document
    # history_len=0 (the default) draws nothing more: the same sessions as ever
    plain = base.generate(9, np.random.default_rng(7))
    assert all(len(t.user.split()) == 5 for s in plain for t in s.turns)
    assert plain == MultiTurn(sessions=3, turns=3, system_len=8, turn_len=5, output_len=2,
                              history_len=0).generate(9, np.random.default_rng(7))
    with pytest.raises(ValueError, match="history_len must be >= 0"):
        MultiTurn(history_len=-1)


def test_history_hit_rate_through_the_runner():
    """A mock server that reports usage (estimated tokens) and caches exactly the history: the
    hit rate is 1 and every later turn of history_len=64 sessions has a history over 64."""

    async def server(request: httpx.Request) -> httpx.Response:
        messages = json.loads(request.content)["messages"]
        prompt = sum(estimate_tokens(m["content"]) for m in messages)
        cached = sum(estimate_tokens(m["content"]) for m in messages[:-1]) if len(messages) > 2 else 0
        chunks = [{"choices": [{"index": 0, "delta": {"content": "a reply"}}]},
                  {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": 2,
                                            "prompt_tokens_details": {"cached_tokens": cached}}}]
        body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, content=body.encode())

    async def go():
        workload = MultiTurn(sessions=2, turns=3, system_len=8, turn_len=4, output_len=2,
                             think_time=0, history_len=64)
        sessions = workload.generate(6, np.random.default_rng(0))
        async with BenchClient(ClientConfig(base_url="http://mock"),
                               httpx.MockTransport(server)) as client:
            return await run_sessions(client, sessions, np.zeros(2), max_concurrency=None,
                                      counter=token_counter(None))

    result = asyncio.run(go())
    m = summarize(result.records, result.duration_s, SLO(), history_threshold=64)["multi_turn"]
    assert (m["first_turns"], m["later_turns"], m["long_history_turns"]) == (2, 4, 4)
    assert m["history_hit_rate"] == 1.0 and m["history_tokens"] > 4 * 64
