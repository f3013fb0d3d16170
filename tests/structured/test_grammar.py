"""StructuredOutput validation and the xgrammar engine on the default model's vocabulary."""

from __future__ import annotations

import json

import pytest
import torch

from radixrelay.model.model_registry import resolve_model_path
from radixrelay.structured import InvalidStructuredOutput, StructuredOutput
from radixrelay.structured.grammar import GrammarEngine
from radixrelay.structured.spec import MAX_SCHEMA_DEPTH, MAX_SPEC_CHARS
from radixrelay.text.tokenizer import load_tokenizer
from radixrelay.worker.constraints import apply_bitmask


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_path("default"))


@pytest.fixture(scope="module")
def engine(tokenizer):
    return GrammarEngine(tokenizer)


def _allowed(engine: GrammarEngine, matcher) -> set[int]:
    bitmask = engine._xgr.allocate_token_bitmask(1, engine.vocab_size)
    matcher.fill_next_token_bitmask(bitmask, 0)
    bits = (bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return set(torch.nonzero(bits.flatten()[:engine.vocab_size]).flatten().tolist())


@pytest.mark.parametrize("make, message", [
    (lambda: StructuredOutput.regex(""), "non-empty"),
    (lambda: StructuredOutput.regex("a" * (MAX_SPEC_CHARS + 1)), "at most"),
    (lambda: StructuredOutput.json_schema("{not json"), "not valid JSON"),
    (lambda: StructuredOutput.json_schema("[1, 2]"), "JSON object"),
    (lambda: StructuredOutput.choice([]), "1 to"),
    (lambda: StructuredOutput.choice(["a", ""]), "non-empty"),
    (lambda: StructuredOutput(kind="regex", value="a", choices=("b",)), "choices apply"),
])
def test_unusable_specs_are_refused_before_compiling(make, message):
    with pytest.raises(InvalidStructuredOutput, match=message):
        make()


def test_schema_depth_is_bounded():
    schema: dict = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH):
        schema = {"type": "array", "items": schema}
    with pytest.raises(InvalidStructuredOutput, match="nested deeper"):
        StructuredOutput.json_schema(schema)


@pytest.mark.parametrize("spec, message", [
    (StructuredOutput.regex("(ab"), "parenthesis"),
    (StructuredOutput.json_schema({"type": "nonsense"}), "nonsense"),
])
def test_engine_refusals_carry_its_message(engine, spec, message):
    with pytest.raises(InvalidStructuredOutput, match=message) as info:
        engine.compile(spec)
    assert "/project/" not in str(info.value) and str(info.value).startswith(spec.kind)


def test_choice_grammar_accepts_exactly_the_choices(engine):
    choices = ["yes", 'a "quoted"\nline', "ünïcode ✓", "back\\slash"]
    compiled = engine.compile(StructuredOutput.choice(choices))
    for choice in choices:
        matcher = engine.matcher(compiled)
        assert matcher.accept_string(choice) and matcher.is_completed()
    for other in ["ye", "yes!", "no"]:
        matcher = engine.matcher(compiled)
        assert not (matcher.accept_string(other) and matcher.is_completed())


def test_special_tokens_are_never_allowed_and_a_finished_grammar_allows_only_eos(engine, tokenizer):
    matcher = engine.matcher(engine.compile(StructuredOutput.json_object()))
    assert matcher.accept_string('{"text":"')
    allowed = _allowed(engine, matcher)
    assert allowed and not allowed & set(tokenizer.special_token_ids)
    assert matcher.accept_string('hi"}')
    assert _allowed(engine, matcher) == set(tokenizer.eos_token_ids)


def test_compiles_are_cached(engine):
    spec = StructuredOutput.regex(r"\d{3}")
    assert engine.compile(spec) is engine.compile(StructuredOutput.regex(r"\d{3}"))


def test_apply_bitmask_masks_only_the_constrained_rows():
    torch.manual_seed(0)
    logits = torch.randn(3, 70)
    bitmask = torch.zeros(1, 3, dtype=torch.int32)                # row 1 allows tokens 0, 33 and 69
    bitmask[0, 0], bitmask[0, 1], bitmask[0, 2] = 1, 1 << 1, 1 << 5
    out = apply_bitmask(logits, torch.tensor([1]), bitmask)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    kept = torch.isfinite(out[1]).nonzero().flatten().tolist()
    assert kept == [0, 33, 69] and torch.equal(out[1, kept], logits[1, kept])
    sign = torch.full((1, 3), -1, dtype=torch.int32)             # bit 31 set: the sign bit
    assert torch.equal(apply_bitmask(logits, torch.tensor([0]), sign), logits)


def test_schema_outputs_follow_the_schema(engine, tokenizer):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"]}
    matcher = engine.matcher(engine.compile(StructuredOutput.json_schema(schema)))
    assert matcher.accept_string('{"n":7}') and matcher.is_completed()
    matcher = engine.matcher(engine.compile(StructuredOutput.json_schema(json.dumps(schema))))
    assert not matcher.accept_string('{"n":12')
