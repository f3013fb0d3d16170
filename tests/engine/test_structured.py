"""Structured outputs through the Engine on the default model (fp32, CPU): outputs follow their
constraints; greedy constrained decoding departs from greedy unconstrained decoding only where the
grammar forbade the unconstrained token; constrained requests batch with unconstrained ones without
changing them; overlap on/off and retraction (a small KV pool: re-admitted grammars replay their
outputs) give identical tokens.

Two engines serve every test but the budget one: ``large`` (a pool for everything, overlap off) runs
the mixed batch and the references; ``small`` (overlap on, a pool of 11 pages that the constrained
requests start in but cannot all grow in) runs the constrained requests alone, so every request it
retracts is a constrained one whose grammar replays its outputs when it is re-admitted."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from radixrelay import Engine, SamplingParams
from radixrelay.structured import StructuredOutput
from radixrelay.structured.grammar import GrammarEngine
from tests.runtime.server_process import TINY_ENGINE

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
MATE = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPTS = ["Describe a person as JSON:", "Pick a color and some tags, as JSON:", "A point, as JSON:",
           "Call me at", "My email address is", "Will it rain tomorrow?", "The capital of France is"]
SMALL = {"kv_cache_tokens": 16 * 11, "page_size": 16, "max_running_requests": 16, "chunked_prefill_tokens": 64}


def _constrained() -> tuple[list[str], list[SamplingParams]]:
    """Every kind of constraint, greedy and seeded. Their outputs take at most 25 tokens; max_tokens
    is kept near that (admission reserves a share of it), so the small pool admits nearly all of them
    at once and runs short as they grow past their first pages."""
    prompts, params = [], []
    for i, schema in enumerate(SCHEMAS):
        for temperature, seed in ((0.0, None), (0.9, 100 + i)):
            prompts.append(PROMPTS[i])
            params.append(SamplingParams(max_tokens=32, temperature=temperature, seed=seed,
                                         structured=StructuredOutput.json_schema(schema)))
    for i, pattern in enumerate(REGEXES):
        prompts.append(PROMPTS[3 + i])
        params.append(SamplingParams(max_tokens=24, temperature=0.8, seed=7 + i, structured=StructuredOutput.regex(pattern)))
    prompts += [PROMPTS[6]] * 2
    params += [SamplingParams(max_tokens=8, temperature=1.0, seed=5, structured=StructuredOutput.choice(CHOICES)),
               SamplingParams(max_tokens=16, temperature=0, logprobs=2, structured=StructuredOutput.json_object())]
    return prompts, params


def _requests() -> tuple[list[str], list[SamplingParams]]:
    """The constrained requests and, last, three unconstrained batch mates."""
    prompts, params = _constrained()
    return prompts + PROMPTS[:3], params + [MATE] * 3


@pytest.fixture(scope="module")
def large():
    with Engine(model="default", kv_cache_tokens=8192, disable_overlap=True) as engine:
        yield engine


@pytest.fixture(scope="module")
def runs(large):
    """The mixed batch on ``large``; then, on ``large``, the batch mates alone with the schemas' prompts
    greedy without constraints (one token past the constrained output: what the first run is compared
    with); the constrained requests alone on ``small``."""
    prompts, params = _requests()
    outs = large.generate(prompts, params)
    greedy = [SamplingParams(max_tokens=len(outs[2 * i].token_ids) + 1, temperature=0) for i in range(len(SCHEMAS))]
    unconstrained = large.generate(PROMPTS[:3] * 2, [MATE] * 3 + greedy)
    with Engine(model="default", **SMALL) as engine:
        small = engine.generate(*_constrained())
        stats = engine.stats()
    return outs, unconstrained[:3], unconstrained[3:], small, stats


def test_outputs_follow_their_constraints(runs):
    outs = runs[0]
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
    outs, free = runs[0], runs[1]
    assert [o.token_ids for o in outs[-3:]] == [o.token_ids for o in free]
    assert all(len(o.token_ids) == MATE.max_tokens for o in free)


def test_greedy_departs_from_unconstrained_only_where_the_grammar_forbids(runs):
    outs, greedy = runs[0], runs[2]
    _, params = _requests()
    from radixrelay.model.model_registry import resolve_model_path
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
    """The small pool (overlap on) retracts constrained requests: re-admitted, their grammars replay
    their outputs, and every token equals the large pool's (overlap off). With overlap, steps launched
    before their predecessor's tokens were known queued their masks and sampling after sending its output
    (``LaunchedStep.deferred``)."""
    outs, small, stats = runs[0], runs[3], runs[4]
    assert stats["num_retractions"] > 0
    assert stats["masked_steps_deferred"] > 0
    assert [o.token_ids for o in small] == [o.token_ids for o in outs[:len(small)]]
    assert all(o.finish_reason == "stop" and o.error is None for o in small)


def test_bad_constraints_raise_before_submitting(large):
    with pytest.raises(ValueError, match="parenthesis"):
        large.generate(["x"], SamplingParams(structured=StructuredOutput.regex("(a")))
    assert large.generate(["x"], SamplingParams(max_tokens=4, temperature=0))[0].error is None


def test_a_grammar_over_its_time_budget_fails_its_request_alone(monkeypatch, tiny_model_dir):
    """With a budget no grammar can keep (1e-6 ms per token), each constrained request ends once its
    window of 16 tokens is full, with the budget's error; its unconstrained batch mate runs to its
    length as if alone (as the same request then runs alone, under a cache salt: computed afresh). The
    budget is the grammar's, whatever the model: the Engine runs the tiny dummy model of
    ``tests/runtime/server_process.py``."""
    monkeypatch.setenv("RADIXRELAY_GRAMMAR_BUDGET_MS", "0.000001")
    long_string = {"type": "object", "properties": {"story": {"type": "string", "minLength": 100}},
                   "required": ["story"]}
    constrained = SamplingParams(max_tokens=64, temperature=0, structured=StructuredOutput.json_schema(long_string))
    with Engine(model=str(tiny_model_dir), **TINY_ENGINE, kv_cache_tokens=2048) as engine:
        hot, mate = engine.generate([PROMPTS[0], PROMPTS[1]], [constrained, MATE])
        failures = engine.stats()["grammar_budget_failures"]
        [alone] = engine.generate([PROMPTS[1]], MATE, cache_salt="alone")
    assert hot.finish_reason == "abort"
    assert hot.error is not None and "structured output too costly" in hot.error and "per token" in hot.error
    assert 15 <= hot.completion_tokens < 64        # the 16th mask is charged before its token is sampled
    assert hot.completion_tokens < MATE.max_tokens  # the mate outlived it
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
