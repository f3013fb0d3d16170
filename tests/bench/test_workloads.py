"""Workload generators: exact request counts, the sharing structure each promises, determinism,
token-length control (checked with the default model's tokenizer), parameter parsing."""

from __future__ import annotations

import json
from collections import defaultdict

import numpy as np
import pytest

from radixrelay.bench.workloads import (WORKLOADS, Agent, FewShot, MultiTenant, MultiTurn, SharedPrefix, ShareGPTLike,
                                        Tree, estimate_tokens, make_workload, words)
from radixrelay.bench.words import WORDS


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


@pytest.fixture(scope="module")
def tokenizer():
    from radixrelay.model.model_registry import resolve_model_path
    from radixrelay.text.tokenizer import load_tokenizer
    return load_tokenizer(resolve_model_path("default"))


@pytest.mark.parametrize("name", sorted(WORKLOADS))
@pytest.mark.parametrize("n", [1, 7, 40])
def test_every_workload_gives_exactly_n_requests_deterministically(name, n):
    workload = make_workload(name, {})
    sessions = workload.generate(n, rng(3))
    assert sum(len(s.turns) for s in sessions) == n
    assert sessions == workload.generate(n, rng(3))
    assert sessions != workload.generate(n, rng(4))
    assert all(t.max_tokens >= 1 and t.user for s in sessions for t in s.turns)


def test_words_are_single_tokens_and_lengths_are_controlled(tokenizer):
    assert len(set(WORDS)) == len(WORDS) == 512
    assert all(len(tokenizer.encode(" " + w, add_special_tokens=False)) == 1 for w in WORDS)
    for n in (16, 256, 1024):
        count = len(tokenizer.encode(words(rng(n), n), add_special_tokens=False))
        assert n <= count <= n + 1


def test_shared_prefix_groups_share_system_prompts_only():
    w = SharedPrefix(groups=3, prompts_per_group=4, system_len=32, question_len=8, output_len=5)
    sessions = w.generate(w.natural_size(), rng())
    by_group = defaultdict(list)
    for s in sessions:
        by_group[s.label].append(s)
    assert sorted(by_group) == ["group-0", "group-1", "group-2"]
    assert all(len(g) == 4 and len({s.system for s in g}) == 1 for g in by_group.values())
    assert len({g[0].system for g in by_group.values()}) == 3
    assert len({s.turns[0].user for s in sessions}) == 12
    assert [s.label for s in sessions] != sorted(s.label for s in sessions)     # interleaved
    assert all(len(s.system.split()) == 32 and s.turns[0].max_tokens == 5 for s in sessions)


def test_tree_shares_one_prefix_and_each_problem_across_samples():
    w = Tree(problems=3, samples=2, prefix_len=20, problem_len=5, output_len=3)
    sessions = w.generate(7, rng())      # 3 full problems and one sample of a fourth
    labels = [s.label for s in sessions]
    assert labels == ["problem-0"] * 2 + ["problem-1"] * 2 + ["problem-2"] * 2 + ["problem-3"]
    prompts = [s.turns[0].user for s in sessions]
    assert prompts[0] == prompts[1] != prompts[2] == prompts[3]
    prefix = prompts[0].split("\n\n")[0]
    assert all(p.startswith(prefix + "\n\nProblem:") for p in prompts)


def test_few_shot_subjects_share_example_blocks():
    w = FewShot(subjects=2, questions_per_subject=3, shots=2, example_len=20, question_len=18)
    sessions = w.generate(6, rng())
    for label in ("subject-0", "subject-1"):
        prompts = [s.turns[0].user for s in sessions if s.label == label]
        block = prompts[0].rsplit("Question:", 1)[0]
        assert len(prompts) == 3 and all(p.startswith(block) for p in prompts)
        assert block.count("Answer:") == 2 and len(set(prompts)) == 3


def test_multi_turn_sessions():
    w = MultiTurn(sessions=2, turns=3, system_len=10, turn_len=4, output_len=2, think_time=0.5)
    sessions = w.generate(8, rng())      # 3 + 3 + 2 turns
    assert [len(s.turns) for s in sessions] == [3, 3, 2]
    assert all(s.turns[0].think_time == 0 and all(t.think_time > 0 for t in s.turns[1:])
               for s in sessions)
    assert len({s.system for s in sessions}) == 3
    no_think = MultiTurn(turns=2, think_time=0).generate(4, rng())
    assert all(t.think_time == 0 for s in no_think for t in s.turns)


def test_multi_tenant_contexts_and_zipf_popularity():
    """Every request of a tenant carries that tenant's own context; tenants differ; popularity falls off
    as Zipf's law says (tenant 0 about twice tenant 1 at exponent 1)."""
    w = MultiTenant(tenants=10, context_len=50, question_len=5, zipf=1.0)
    sessions = w.generate(4000, rng(3))
    contexts = defaultdict(set)
    for s in sessions:
        contexts[s.label].add(s.system)
    assert all(len(c) == 1 for c in contexts.values()) and len({next(iter(c)) for c in contexts.values()}) == len(contexts)
    counts = [sum(s.label == f"tenant-{t}" for s in sessions) for t in range(10)]
    assert counts == sorted(counts, reverse=True) or counts[0] > counts[4] > counts[9]
    assert 1.6 < counts[0] / counts[1] < 2.4
    assert make_workload("multi-tenant", {"tenants": "4", "zipf": "1.5"}) == MultiTenant(tenants=4, zipf=1.5)


def test_agent_sessions_share_one_schema_and_append_tool_results():
    """Every session carries the same tool-schema system prompt; the first turn is a task, each later one a
    tool result of about ``result_len`` tokens after a tool latency; calls are ``call_len`` tokens out."""
    sessions = Agent(sessions=3, turns=4, schema_len=40, task_len=8, result_len=30, call_len=16).generate(10, rng(5))
    assert [len(s.turns) for s in sessions] == [4, 4, 2]
    assert len({s.system for s in sessions}) == 1 and estimate_tokens(sessions[0].system) >= 40
    for s in sessions:
        assert s.turns[0].user.startswith("Task: ") and s.turns[0].think_time == 0
        assert all(t.user.startswith("<tool_response>") and t.think_time > 0 for t in s.turns[1:])
        assert all(t.max_tokens == 16 for t in s.turns)
    assert 30 <= estimate_tokens(sessions[0].turns[1].user) <= 40
    assert make_workload("agent", {"schema-len": "100"}) == Agent(schema_len=100)


def test_sharegpt_like_lengths_match_published_means():
    sessions = ShareGPTLike().generate(20000, rng())
    inputs = np.array([len(s.turns[0].user.split()) for s in sessions])
    outputs = np.array([s.turns[0].max_tokens for s in sessions])
    assert inputs.min() >= 4 and inputs.max() <= 1024 and outputs.max() <= 1024
    # log-normal means 161 / 338, lowered a little by the clipping at 1024
    assert 0.85 * 161 < inputs.mean() < 1.05 * 161
    assert 0.85 * 338 < outputs.mean() < 1.05 * 338


def test_sharegpt_file(tmp_path):
    data = [{"conversations": [{"from": "human", "value": "What is the capital of France, please?"},
                               {"from": "gpt", "value": "Paris is the capital of France."}]},
            {"conversations": [{"from": "human", "value": "hi"}]},       # no reply: skipped
            {"conversations": [{"from": "human", "value": "Tell me a joke about cats now."},
                               {"from": "gpt", "value": "No."}]}]           # reply too short
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    sessions = make_workload("sharegpt-like", {"path": str(path)}).generate(3, rng())
    assert {s.turns[0].user for s in sessions} == {"What is the capital of France, please?"}
    assert sessions[0].turns[0].max_tokens == 7          # "Paris is the capital of France ."
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="no usable conversations"):
        make_workload("sharegpt-like", {"path": str(tmp_path / "bad.json")}).generate(1, rng())


def test_make_workload_parses_and_validates_parameters():
    w = make_workload("shared-prefix", {"groups": "2", "system-len": "7"})
    assert w == SharedPrefix(groups=2, system_len=7)
    assert make_workload("multi-turn", {"think_time": "0.25"}).think_time == 0.25
    with pytest.raises(ValueError, match="unknown workload"):
        make_workload("nope", {})
    with pytest.raises(ValueError, match="no parameter 'bogus'.*groups"):
        make_workload("shared-prefix", {"bogus": "1"})
    with pytest.raises(ValueError, match="not a valid int"):
        make_workload("tree", {"samples": "two"})
    with pytest.raises(ValueError, match="samples must be >= 1"):
        make_workload("tree", {"samples": "0"})
    with pytest.raises(ValueError, match="output_len must be >= 1"):
        make_workload("random", {"output_len": "-1"})
