"""Structured outputs through the Engine on the default model (fp32, CPU): outputs follow their
constraints; greedy constrained decoding departs from greedy unconstrained decoding only where the
grammar forbade the unconstrained token; constrained requests batch with unconstrained ones without
changing them; overlap on/off and retraction (a small KV pool: re-admitted grammars replay their
outputs) give identical tokens."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from radixrelay import Engine, SamplingParams
from radixrelay.structured import StructuredOutput
from radixrelay.structured.grammar import GrammarEngine

pytestmark = pytest.mark.slow

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                               "maxItems": 3}},
     "required": ["color", "tags"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -50, "maximum": 50},
        "y": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["x", "y"]},
        "ok": {"type": "boolean"}}, "required": ["point", "ok"]},
]
REGEXES = [r"\d{3}-\d{4}", r"[a-z]{2,8}@[a-z]{3,6}\.(com|org)", r"(yes|no|maybe), because [a-z ]{5,20}\."]
CHOICES = ["Paris", "London", "Rome", "Berlin"]
MATE = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)    # long: the small pool retracts
PROMPTS = ["Describe a person as JSON:", "Pick a color and some tags, as JSON:", "A point, as JSON:",
           "Call me at", "My email address is", "Will it rain tomorrow?", "The capital of France is"]


def _requests() -> tuple[list[str], list[SamplingParams]]:
    prompts, params = [], []
    for i, schema in enumerate(SCHEMAS):
        for temperature, seed in ((0.0, None), (0.9, 100 + i)):
            prompts.append(PROMPTS[i])
            params.append(SamplingParams(max_tokens=96, temperature=temperature, seed=seed,
                                         structured=StructuredOutput.json_schema(schema)))
    for i, pattern in enumerate(REGEXES):
        prompts.append(PROMPTS[3 + i])
        params.append(SamplingParams(max_tokens=48, temperature=0.8, seed=7 + i, structured=StructuredOutput.regex(pattern)))
    prompts += [PROMPTS[6]] * 2
    params += [SamplingParams(max_tokens=8, temperature=1.0, seed=5, structured=StructuredOutput.choice(CHOICES)),
               SamplingParams(max_tokens=32, temperature=0, logprobs=2, structured=StructuredOutput.json_object())]
    # Unconstrained batch mates (compared with a run without any constraint).
    prompts += PROMPTS[:3]
    params += [MATE] * 3
    return prompts, params


def _run(unconstrained: bool = False, **options):
    """The mixed batch; with ``unconstrained`` also the batch mates alone and the schemas' prompts greedy
    without constraints (what the first run's outputs are compared with)."""
    prompts, params = _requests()
    free = greedy = None
    with Engine(model="default", **options) as engine:
        outs = engine.generate(prompts, params)
        stats = engine.stats()
        if unconstrained:
            free = engine.generate(PROMPTS[:3], MATE)
            greedy = engine.generate(PROMPTS[:3], SamplingParams(max_tokens=96, temperature=0))
    return outs, stats, free, greedy


@pytest.fixture(scope="module")
def runs():
    large = _run(unconstrained=True, kv_cache_tokens=8192)
    small = _run(kv_cache_tokens=192, page_size=16, max_running_requests=8, chunked_prefill_tokens=64)
    lockstep = _run(kv_cache_tokens=192, page_size=16, max_running_requests=8, chunked_prefill_tokens=64,
                    disable_overlap=True)
    return large, small, lockstep


def test_outputs_follow_their_constraints(runs):
    outs = runs[0][0]
    _, params = _requests()
    for out, p in zip(outs, params):
        spec = p.structured
        assert out.error is None
        if spec is None:
            continue
        assert out.finish_reason == "stop", (spec, out.text)
        if spec.kind == "json_schema":
            jsonschema.validate(json.loads(out.text), json.loads(spec.value))
        elif spec.kind == "json_object":
            assert isinstance(json.loads(out.text), dict) and len(out.logprobs) == len(out.token_ids)
        elif spec.kind == "regex":
            assert re.fullmatch(spec.value, out.text), (spec.value, out.text)
        else:
            assert out.text in CHOICES


def test_unconstrained_batch_mates_are_unchanged(runs):
    outs, _, free, _ = runs[0]
    assert [o.token_ids for o in outs[-3:]] == [o.token_ids for o in free]


def test_greedy_departs_from_unconstrained_only_where_the_grammar_forbids(runs):
    outs, _, _, greedy = runs[0]
    _, params = _requests()
    from radixrelay.model.registry import resolve_model_path
    from radixrelay.text.tokenizer import load_tokenizer

    engine = GrammarEngine(load_tokenizer(resolve_model_path("default")))
    for i, schema in enumerate(SCHEMAS):
        constrained, free = outs[2 * i].token_ids, greedy[i].token_ids
        assert params[2 * i].greedy
        common = next((k for k, (a, b) in enumerate(zip(constrained, free)) if a != b), None)
        if common is None:
            continue          # one is a prefix of the other: nothing departed
        matcher = engine.matcher(engine.compile(StructuredOutput.json_schema(schema)))
        for token in constrained[:common]:
            assert matcher.accept_token(token)
        bitmask = engine._xgr.allocate_token_bitmask(1, engine.vocab_size)
        matcher.fill_next_token_bitmask(bitmask, 0)
        word, bit = divmod(free[common], 32)
        assert not (int(bitmask[0, word]) >> bit) & 1, f"schema {i}: token {free[common]} was allowed at {common}"


def test_identical_with_retraction_and_with_overlap_off(runs):
    (large, _, _, _), (small, stats, _, _), (lockstep, _, _, _) = runs
    assert stats["num_retractions"] > 0
    assert [o.token_ids for o in small] == [o.token_ids for o in large]
    assert [o.token_ids for o in lockstep] == [o.token_ids for o in large]


def test_bad_constraints_raise_before_submitting():
    with Engine(model="default", kv_cache_tokens=1024) as engine:
        with pytest.raises(ValueError, match="parenthesis"):
            engine.generate(["x"], SamplingParams(structured=StructuredOutput.regex("(a")))
        assert engine.generate(["x"], SamplingParams(max_tokens=4, temperature=0))[0].error is None


def test_retracted_constrained_requests_resume_their_grammar():
    """Four long constrained requests on a pool that holds about two: retraction re-admits them with
    their outputs, which their grammars replay; tokens equal a pool large enough for all four."""
    prompts = ["Tell me a story:", "Describe the sea:", "Write about trees:", "Explain the sky:"]
    params = [SamplingParams(max_tokens=120, temperature=0.7, seed=i,
                             structured=StructuredOutput.regex(r"[a-z ]{200,256}\.")) for i in range(4)]
    runs = []
    for kv in (128, 4096):
        with Engine(model="default", kv_cache_tokens=kv, page_size=16, max_running_requests=4) as engine:
            runs.append((engine.generate(prompts, params), engine.stats()["num_retractions"]))
    (small, retractions), (large, _) = runs
    assert retractions > 0
    assert [o.token_ids for o in small] == [o.token_ids for o in large]
    assert all(re.fullmatch(r"[a-z ]{200,256}\.", o.text) for o in small)


def test_a_grammar_over_its_time_budget_fails_its_request_alone(monkeypatch):
    """With a budget no grammar can keep (1e-6 ms per token), each constrained request ends once its
    window of 16 tokens is full, with the budget's error; its unconstrained batch mate runs to its
    length as if alone."""
    monkeypatch.setenv("RADIXRELAY_GRAMMAR_BUDGET_MS", "0.000001")
    long_string = {"type": "object", "properties": {"story": {"type": "string", "minLength": 100}},
                   "required": ["story"]}
    constrained = SamplingParams(max_tokens=64, temperature=0, structured=StructuredOutput.json_schema(long_string))
    with Engine(model="default", kv_cache_tokens=2048) as engine:
        hot, mate = engine.generate([PROMPTS[0], PROMPTS[6]], [constrained, MATE])
        alone = engine.generate([PROMPTS[6]], MATE)[0]
        failures = engine.stats()["grammar_budget_failures"]
    assert hot.finish_reason == "abort"
    assert hot.error is not None and "structured output too costly" in hot.error and "per token" in hot.error
    assert 15 <= hot.completion_tokens < 64        # the 16th mask is charged before its token is sampled
    assert (mate.finish_reason, mate.token_ids) == ("length", alone.token_ids)
    assert failures == 1                           # counted once, by the worker


def test_grammar_budget_setting_is_checked(monkeypatch):
    from radixrelay.env import grammar_budget_ms

    for bad in ("0", "-1", "ten", "nan"):
        monkeypatch.setenv("RADIXRELAY_GRAMMAR_BUDGET_MS", bad)
        with pytest.raises(ValueError, match="RADIXRELAY_GRAMMAR_BUDGET_MS"):
            grammar_budget_ms()
    monkeypatch.setenv("RADIXRELAY_GRAMMAR_BUDGET_MS", "2.5")
    assert grammar_budget_ms() == 2.5
