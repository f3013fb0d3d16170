"""The Python builder makes the parser's AST and is validated by the same function."""

from __future__ import annotations

import re

import pytest

from radixrelay.modules.builder import assistant, module, param, scaffold, schema, system, text, union, user
from radixrelay.modules.pml import (
    Limits,
    Module,
    Param,
    Role,
    Scaffold,
    Schema,
    SchemaError,
    Text,
    Union,
    parse_schema,
    to_pml,
)
from tests.modules.test_pml import CITIES


def cities() -> Schema:
    return schema(
        "cities",
        system("You are a travel guide."),
        module("city-info", "Facts about cities."),
        module("trip-plan", "Plan a trip of ", param("duration", 2), " days.\n     ",
               module("budget", "Keep it cheap.")),
        union(module("tokyo", "Tokyo is ..."), module("miami", "Miami is ...")),
        scaffolds=[scaffold("both", "city-info", "trip-plan")],
    )


def test_builder_equals_parser() -> None:
    assert cities() == parse_schema(CITIES)


def test_round_trip_through_pml() -> None:
    s = cities()
    assert parse_schema(to_pml(s)) == s
    assert parse_schema(to_pml(s, indent=None)) == s


def test_all_constructs() -> None:
    s = schema("s", "lead", user("Q ", module("q", "about ", param("t", 3))),
               module("shot", user("2+2?"), assistant("4")), text("tail"))
    assert s == Schema("s", (
        Text("lead"),
        Role("user", (Text("Q "), Module("q", (Text("about "), Param("t", 3))))),
        Module("shot", (Role("user", (Text("2+2?"),)), Role("assistant", (Text("4"),)))),
        Text("tail"),
    ))
    assert parse_schema(to_pml(s)) == s


def test_strings_normalised() -> None:
    m = module("m", "a", " ", Text("b"), "\n\t", param("p", 1), "  ", "c", "d")
    assert m == Module("m", (Text("ab"), Param("p", 1), Text("cd")))
    assert system(" ", "\n") == Role("system", ())


def test_builder_returns_plain_ast() -> None:
    assert union(module("a")) == Union((Module("a", ()),))
    assert scaffold("x", "a", "b") == Scaffold("x", ("a", "b"))


def _parsed_error(doc: str) -> str:
    with pytest.raises(SchemaError) as info:
        parse_schema(doc)
    return str(info.value)


def _built_error(build) -> str:  # type: ignore[no-untyped-def]
    with pytest.raises(SchemaError) as info:
        build()
    return str(info.value)


@pytest.mark.parametrize("build, doc", [
    (lambda: schema("s", module("a"), module("a")), '<schema name="s"><module name="a"/><module name="a"/></schema>'),
    (lambda: schema("s", module("m", param("p", 0))),
     '<schema name="s"><module name="m"><param name="p" len="0"/></module></schema>'),
    (lambda: schema("s", module("m", param("p", 1), param("p", 2))),
     '<schema name="s"><module name="m"><param name="p" len="1"/><param name="p" len="2"/></module></schema>'),
    (lambda: schema("s", union()), '<schema name="s"><union/></schema>'),
    (lambda: schema("s", user(system("x"))), '<schema name="s"><user><system>x</system></user></schema>'),
    (lambda: schema("s", param("p", 1)), '<schema name="s"><param name="p" len="1"/></schema>'),
    (lambda: schema("s", module("a"), scaffolds=[scaffold("x", "a", "b")]),
     '<schema name="s"><module name="a"/><scaffold name="x" modules="a b"/></schema>'),
    (lambda: schema("s", module("a"), scaffolds=[scaffold("x", "a")]),
     '<schema name="s"><module name="a"/><scaffold name="x" modules="a"/></schema>'),
    (lambda: schema("s", module("a b")), '<schema name="s"><module name="a b"/></schema>'),
    (lambda: schema("s", module("assistant")), '<schema name="s"><module name="assistant"/></schema>'),
])
def test_same_rules_same_messages(build, doc: str) -> None:  # type: ignore[no-untyped-def]
    # The parser's messages carry line numbers; otherwise they are the builder's, word for word.
    assert re.sub(r" \((first defined at )?line 1\)", "", _parsed_error(doc)) == _built_error(build)


def test_builder_only_errors() -> None:
    with pytest.raises(SchemaError, match="union members must be modules, got str at index 0"):
        schema("s", union("text"))  # type: ignore[arg-type]
    with pytest.raises(SchemaError, match=r"character U\+0001"):
        schema("s", "a\x01")
    with pytest.raises(SchemaError, match="more than 2 modules"):
        schema("s", module("a"), module("b"), module("c"), limits=Limits(max_modules=2))
    deep = module("leaf")
    for i in range(1000):
        deep = module(f"m{i}", deep)
    with pytest.raises(SchemaError, match="nested deeper than 32"):
        schema("s", deep)
