"""Overlap scheduling changes no output: the default model (fp32, CPU) through two Engines, one
overlapping each step's planning and launch with the previous step, one in lock step
(``disable_overlap``), on a workload with queueing, chunked prefill, retraction, stop strings, EOS,
seeded sampling, penalties, logprobs and prompt logprobs. Greedy and seeded outputs are
token-identical; usage counts only emitted tokens (a finish found one step late computes one
extra token that is never returned)."""

from __future__ import annotations

import pytest

from radixrelay import Engine, SamplingParams

# Prompts of 13-14 tokens and at most 6 output tokens: each request is admitted with one page (its
# prompt and the 30% of its max_tokens kept in reserve fit in 16 tokens); one that outgrows it needs a
# second page for its 5th token. The first five fill the five-page pool and four of them run to 6
# tokens: decode runs short of pages and retracts. The rest queue behind them.
QUESTIONS = [f"Q{i}: {i} plus {i + 1} equals what? It equals" for i in range(10)]
PARAMS = [
    SamplingParams(max_tokens=6, temperature=0),                                    # ends with EOS
    SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=6, temperature=0.8, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=6, temperature=0.9, top_p=0.9, seed=11, repetition_penalty=1.3,
                   frequency_penalty=0.5, presence_penalty=0.4, ignore_eos=True),
    SamplingParams(max_tokens=6, temperature=0, logprobs=3, ignore_eos=True),
    SamplingParams(max_tokens=6, temperature=0, stop=(".", "\n")),
    SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=2, ignore_eos=True),
    SamplingParams(max_tokens=1, temperature=0),
    SamplingParams(max_tokens=6, temperature=0.7, top_k=20, seed=3, frequency_penalty=1.0),
    SamplingParams(max_tokens=6, temperature=0, stop_token_ids=(13, 30)),
]


def _run(disable_overlap: bool):
    # Small KV and running limits: requests queue, prefill in chunks, and decode retracts.
    with Engine(model="default", kv_cache_tokens=16 * 5, page_size=16, max_running_requests=8,
                chunked_prefill_tokens=48, disable_overlap=disable_overlap) as engine:
        outs = engine.generate(QUESTIONS, PARAMS)
        return outs, engine.stats()


@pytest.fixture(scope="module")
def runs():
    return _run(disable_overlap=True), _run(disable_overlap=False)


def test_outputs_identical_with_and_without_overlap(runs):
    (lockstep, _), (overlap, _) = runs
    for params, a, b in zip(PARAMS, lockstep, overlap):
        assert a.error is None and b.error is None
        assert b.token_ids == a.token_ids, params
        assert b.text == a.text and b.finish_reason == a.finish_reason
        assert b.completion_tokens == a.completion_tokens <= params.max_tokens
        if params.logprobs is not None:
            assert [[t for t, _ in lp.top] for lp in b.logprobs] == [[t for t, _ in lp.top] for lp in a.logprobs]
            assert [lp.logprob for lp in b.logprobs] == pytest.approx([lp.logprob for lp in a.logprobs], abs=1e-4)
        if params.prompt_logprobs is not None:
            assert len(b.prompt_logprobs) == len(a.prompt_logprobs) > 1
            assert [e and e.logprob for e in b.prompt_logprobs] == pytest.approx(
                [e and e.logprob for e in a.prompt_logprobs], abs=1e-4)


def test_workload_exercised_queueing_retraction_and_stops(runs):
    (_, stats_a), (overlap, stats_b) = runs
    # Lock step retracts; overlap may not: with a step in flight it waits for that step's output
    # instead (finishes often free enough), and retracts only with nothing in flight.
    assert stats_a["num_retractions"] > 0
    assert overlap[5].finish_reason == "stop" and overlap[7].completion_tokens == 1
    # EOS ended the first request: counted in its usage, not among its tokens
    assert overlap[0].finish_reason == "stop" and overlap[0].completion_tokens == len(overlap[0].token_ids) + 1
    for stats in (stats_a, stats_b):       # everything was freed: only the radix cache holds KV
        assert stats["num_running"] == stats["num_waiting"] == 0
        assert stats["locked_tokens"] == 0
