"""Constraints whose language is empty (no finite output satisfies them) are refused when compiled,
with a message saying so; constraints that some output satisfies never are. ``emptiness`` reads
xgrammar's printed EBNF: its character classes, escapes and ``Regex(...)`` elements as xgrammar
prints them."""

from __future__ import annotations

import pytest

from radixrelay.model.model_registry import resolve_model_path
from radixrelay.structured import InvalidStructuredOutput, StructuredOutput
from radixrelay.structured.emptiness import class_is_empty, language_is_empty, unescape_string
from radixrelay.structured.grammar import GrammarEngine
from radixrelay.text.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def engine():
    return GrammarEngine(load_tokenizer(resolve_model_path("default")))


SELF_ONLY = {"anyOf": [{"$ref": "#"}, {"$ref": "#"}]}
EMPTY = [
    StructuredOutput.json_schema(SELF_ONLY),                             # nothing allowed at the start
    StructuredOutput.json_schema({"oneOf": [{"$ref": "#"}, {"$ref": "#"}]}),
    StructuredOutput.json_schema({"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/b"}, {"$ref": "#/$defs/a"}]},
                                            "b": {"allOf": [{"$ref": "#/$defs/a"}]}},
                                  "$ref": "#/$defs/a"}),
    # "[" is allowed first, then no item can end: a dead end below the start
    StructuredOutput.json_schema({"type": "array", "minItems": 1,
                                  "items": {"anyOf": [{"$ref": "#/items"}, {"$ref": "#/items"}]}}),
    StructuredOutput.json_schema({"type": "object", "required": ["a"], "properties": {
        "a": {"anyOf": [{"$ref": "#/properties/a"}, {"$ref": "#/properties/a"}]}}}),
    StructuredOutput.json_schema({"type": "string", "pattern": "[^\\s\\S]"}),
    StructuredOutput.json_schema({"type": "string", "pattern": "^x[^\\x00-\\U0010FFFF]$"}),   # a Regex(...) element
    StructuredOutput.regex("[^\\s\\S]"),
    StructuredOutput.regex("ab[^\\x00-\\U0010FFFF]+"),
]
NOT_EMPTY = [
    StructuredOutput.json_object(),
    StructuredOutput.json_schema({"type": "object", "properties": {"name": {"type": "string"},
                                  "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name"]}),
    # recursion through optional places: finite values exist
    StructuredOutput.json_schema({"type": "array", "items": {"anyOf": [{"$ref": "#/items"}, {"$ref": "#/items"}]}}),
    StructuredOutput.json_schema({"type": "object", "properties": {
        "a": {"anyOf": [{"$ref": "#/properties/a"}, {"$ref": "#/properties/a"}]}}}),
    StructuredOutput.json_schema({"$defs": {"node": {"type": "object", "required": ["v"], "properties": {
        "v": {"type": "integer"}, "next": {"$ref": "#/$defs/node"}}}}, "$ref": "#/$defs/node"}),
    StructuredOutput.json_schema({"anyOf": [{"$ref": "#"}, {"type": "null"}]}),
    StructuredOutput.json_schema({"type": "string", "pattern": "^[a-z]+\\d{2}$"}),
    StructuredOutput.json_schema({"type": "string", "format": "date-time"}),
    StructuredOutput.json_schema({"enum": ["a", 1, None, True]}),
    StructuredOutput.json_schema({"type": "integer", "minimum": -5, "maximum": 5}),
    StructuredOutput.regex("x{0}"),                          # only the empty output: still satisfiable
    StructuredOutput.regex("(ab|c)+d*e?[^a]\\]\\-[\\]\\-\\\\^]"),
    StructuredOutput.regex("[^\\x00-\\x7f]{2,3}"),
    StructuredOutput.choice(["yes", "no", 'a "quoted"\nline']),
]


@pytest.mark.parametrize("spec", EMPTY, ids=lambda s: s.value or s.kind)
def test_a_constraint_nothing_satisfies_is_refused(engine, spec):
    with pytest.raises(InvalidStructuredOutput, match="no output could satisfy it") as info:
        engine.compile(spec)
    assert str(info.value).startswith(spec.kind)


@pytest.mark.parametrize("spec", NOT_EMPTY, ids=lambda s: s.value or ",".join(s.choices) or s.kind)
def test_a_satisfiable_constraint_compiles(engine, spec):
    compiled = engine.compile(spec)
    assert language_is_empty(str(compiled.grammar), regex_is_empty=engine._regex_is_empty) is False


def test_the_reading_of_classes_and_strings():
    assert class_is_empty("[^\\0-\\U0010ffff]") and class_is_empty("[]")
    assert class_is_empty("[^\\x00-\\x7f\\x80-\\U0010ffff]")
    assert not class_is_empty("[^\\x00-\\x7e\\x80-\\U0010ffff]")            # 0x7f is left
    assert not class_is_empty("[^\\-a]") and not class_is_empty("[a-]") and not class_is_empty("[-]")
    assert unescape_string('"\\"q\\\\\\n\\x41\\u00e9\\U0001f600"') == '"q\\\nAé😀'


def test_text_it_cannot_read_is_unknown_never_empty():
    assert language_is_empty("root ::= TagDispatch((\"a\", b))") is None
    assert language_is_empty("other ::= \"a\"") is None                   # no root rule
    assert language_is_empty("root ::= ((root_1))\nroot_1 ::= ((root))") is True
    assert language_is_empty("root ::= ((undefined_rule))") is False      # not ours to judge


def test_class_escapes_read_as_xgrammar_prints_them(engine):
    """Every code point below 0x3000 (and a few above) printed by xgrammar inside a class reads back
    as itself: a class of all code points but one is not empty, of all of them is."""
    import xgrammar as xgr

    for code in [*range(0, 0x3000, 7), 0x5C, 0x5D, 0x2D, 0x5E, 0x22, 0xFFFF, 0x10000, 0x10FFFF]:
        below = f"\\U{code - 1:08x}" if code else ""
        above = f"\\U{code + 1:08x}" if code < 0x10FFFF else ""
        parts = ([f"\\U00000000-{below}"] if code > 0 else []) + ([f"{above}-\\U0010ffff"] if above else [])
        printed = str(xgr.Grammar.from_ebnf(f"root ::= [^{''.join(parts)}]")).strip()
        assert printed.startswith("root ::= ") and language_is_empty(printed) is False, (code, printed)
        single = str(xgr.Grammar.from_ebnf(f"root ::= [^\\U{code:08x}{''.join(parts)}]")).strip()
        assert language_is_empty(single) is True, (code, single)

