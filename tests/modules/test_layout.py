"""Position-ID layout of schemas and prompt plans, checked exactly on a one-token-per-character encoder."""

from __future__ import annotations

import pytest

from radixrelay.modules.builder import assistant, module, param, scaffold, schema, union, user
from radixrelay.modules.layout import (
    ModuleLayout,
    ModuleSegment,
    ParamSegment,
    SchemaLayout,
    TextSegment,
    layout,
)
from radixrelay.modules.pml import (
    Import,
    Limits,
    Prompt,
    Role,
    Schema,
    SchemaError,
    Text,
    parse_schema,
    prompt_from_str,
)

PH = 0  # placeholder id


def enc(s: str) -> list[int]:
    return [ord(c) for c in s]


def ids(s: str) -> tuple[int, ...]:
    return tuple(ord(c) for c in s)


def span(a: int, b: int) -> tuple[int, ...]:
    return tuple(range(a, b))


def chatml(role: str) -> tuple[str, str]:
    return f"<{role[0]}>", "</>"


def test_flat_modules_and_anonymous_segments() -> None:
    s = schema("s", "AB", module("m", "xyz"), "CD", module("n", "q"))
    lay = layout(s, enc, placeholder_id=PH)
    assert list(lay.modules) == ["#0", "m", "#1", "n"]
    assert lay.modules["#0"] == ModuleLayout("#0", ids("AB"), span(0, 2), {}, None, None, True, 0, 2)
    assert lay.modules["m"] == ModuleLayout("m", ids("xyz"), span(2, 5), {}, None, None, False, 2, 5)
    assert lay.modules["#1"] == ModuleLayout("#1", ids("CD"), span(5, 7), {}, None, None, True, 5, 7)
    assert lay.modules["n"].positions == (7,)
    assert lay.end == 8 and lay.schema_name == "s"


def test_params_offsets_and_placeholders() -> None:
    s = schema("s", module("m", "ab", param("p", 3), "c", param("q", 2)))
    m = layout(s, enc, placeholder_id=PH).modules["m"]
    assert m.token_ids == (*ids("ab"), PH, PH, PH, *ids("c"), PH, PH)
    assert m.positions == span(0, 8)
    assert m.params == {"p": (2, 3), "q": (6, 2)}


def test_nested_module_sits_between_parent_tokens() -> None:
    s = schema("s", module("m", "ab", module("n", "xyz", module("o", "Q")), "cd"), module("k", "K"))
    lay = layout(s, enc, placeholder_id=PH)
    assert list(lay.modules) == ["m", "n", "o", "k"]  # document order: parent before child
    m, n, o, k = (lay.modules[x] for x in "mnok")
    assert (m.token_ids, m.positions, m.start, m.end) == (ids("abcd"), (0, 1, 6, 7), 0, 8)
    assert (n.positions, n.parent, n.start, n.end) == (span(2, 5), "m", 2, 6)
    assert (o.positions, o.parent) == ((5,), "n")
    assert k.positions == (8,) and lay.end == 9


def test_union_members_share_start_and_reserve_longest() -> None:
    s = schema("s", union(module("a", "1"), module("b", "222", module("b1", "xx")), module("c", "33")),
               module("after", "z"))
    lay = layout(s, enc, placeholder_id=PH)
    a, b, b1, c = (lay.modules[x] for x in ("a", "b", "b1", "c"))
    assert a.positions == (0,) and b.positions == span(0, 3) and c.positions == (0, 1)
    assert (a.start, b.start, c.start) == (0, 0, 0)
    assert b1.positions == (3, 4) and b1.parent == "b" and b1.union is None
    assert b.end == 5  # longest member span includes its nested child
    assert (a.union, b.union, c.union) == (0, 0, 0)
    assert lay.modules["after"].positions == (5,) and lay.end == 6


def test_union_indices_and_union_inside_module() -> None:
    s = schema("s", union(module("a", "1")), module("m", "x", union(module("p", "pp"), module("q", "q")), "y"))
    lay = layout(s, enc, placeholder_id=PH)
    assert lay.modules["a"].union == 0
    assert (lay.modules["p"].union, lay.modules["p"].parent) == (1, "m")
    assert lay.modules["p"].positions == (2, 3) and lay.modules["q"].positions == (2,)
    assert lay.modules["m"].positions == (1, 4)


def test_roles_markers_anonymous_and_inside_modules() -> None:
    s = schema("s", user("hi", module("m", "x")), module("ex", user("Q"), assistant("A", param("p", 1))))
    lay = layout(s, enc, placeholder_id=PH, role_text=chatml)
    assert lay.role_markers == {"system": ("<s>", "</>"), "user": ("<u>", "</>"), "assistant": ("<a>", "</>")}
    # Markers are encoded separately from the text they surround.
    assert lay.modules["#0"].token_ids == ids("<u>hi") and lay.modules["#0"].positions == span(0, 5)
    assert lay.modules["m"].positions == (5,)
    assert lay.modules["#1"].token_ids == ids("</>") and lay.modules["#1"].positions == span(6, 9)
    ex = lay.modules["ex"]
    assert ex.token_ids == (*ids("<u>Q</><a>A"), PH, *ids("</>"))
    assert ex.positions == span(9, 9 + 15) and ex.params == {"p": (11, 1)}
    # Without role_text roles add nothing.
    plain = layout(s, enc, placeholder_id=PH)
    assert plain.modules["#0"].token_ids == ids("hi") and "#1" not in plain.modules
    assert plain.modules["ex"].token_ids == (*ids("QA"), PH)


def test_each_piece_encoded_separately() -> None:
    calls: list[str] = []

    def spy(s: str) -> list[int]:
        calls.append(s)
        return [len(s)]  # one token per piece: boundaries are visible

    s = schema("s", "ab", user("cd"), module("m", "ef", param("p", 2), "gh"))
    lay = layout(s, spy, placeholder_id=PH, role_text=chatml)
    assert calls == ["ab", "<u>", "cd", "</>", "ef", "gh"]
    assert lay.modules["#0"].token_ids == (2, 3, 2, 3)
    assert lay.modules["m"].token_ids == (2, PH, PH, 2)


def test_scaffolds_and_validation() -> None:
    s = schema("s", module("a", "x"), module("b", "y"), scaffolds=[scaffold("ab", "a", "b")])
    assert layout(s, enc, placeholder_id=PH).scaffolds == {"ab": ("a", "b")}
    with pytest.raises(SchemaError, match="adjacent Text"):
        layout(Schema("s", (Text("a"), Text("b"))), enc, placeholder_id=PH)


def test_cities_example() -> None:
    s = parse_schema('<schema name="cities"><system>You are a travel guide.</system>'
                     '<module name="trip-plan">Plan <param name="duration" len="2"/> days.'
                     '<module name="budget">Cheap.</module></module>'
                     '<union><module name="tokyo">Tokyo</module><module name="miami">Miami!</module></union>'
                     '</schema>')
    lay = layout(s, enc, placeholder_id=PH)
    assert [(m.name, m.start, m.end) for m in lay.modules.values()] == [
        ("#0", 0, 23), ("trip-plan", 23, 42), ("budget", 36, 42), ("tokyo", 42, 47), ("miami", 42, 48)]
    assert lay.end == 48


# ─────────────────────────────────────────────────────────────── prompt plans


@pytest.fixture()
def lay() -> SchemaLayout:
    # #0 "AB"@0-1 | m "xy" PH PH PH "z" @2-7 (n "qq"@8-9 nested at the end) | #1 "C"@10 |
    # union{u1 "1"@11, u2 "222"@11-13} | k "K"@14 | #2 "END"@15-17
    s = schema("s", "AB", module("m", "xy", param("p", 3), "z", module("n", "qq")), "C",
               union(module("u1", "1"), module("u2", "222")), module("k", "K"), "END",
               scaffolds=[scaffold("mk", "m", "k")])
    return layout(s, enc, placeholder_id=PH)


def plan(lay: SchemaLayout, doc: str) -> list:
    return list(lay.prompt_plan(prompt_from_str(doc), enc).segments)


def test_layout_of_fixture(lay: SchemaLayout) -> None:
    assert {n: m.positions for n, m in lay.modules.items()} == {
        "#0": (0, 1), "m": span(2, 8), "n": (8, 9), "#1": (10,), "u1": (11,), "u2": span(11, 14),
        "k": (14,), "#2": span(15, 18)}


def test_plan_only_anonymous_segments_then_text(lay: SchemaLayout) -> None:
    p = lay.prompt_plan(prompt_from_str('<prompt schema="s">hi</prompt>'), enc)
    assert list(p.segments) == [ModuleSegment("#0"), ModuleSegment("#1"), ModuleSegment("#2"),
                                TextSegment(ids("hi"), (18, 19))]
    assert p.end == 20 and p.scaffolds == () and p.schema_name == "s"


def test_plan_text_before_between_after(lay: SchemaLayout) -> None:
    segs = plan(lay, '<prompt schema="s">T<m p="ab"/>mid<k/>tail</prompt>')
    assert segs == [
        ModuleSegment("#0"),                      # leading schema text comes before any new text
        TextSegment(ids("T"), (2,)),              # after #0 (ends at 1): frontier 2
        ModuleSegment("m"),
        ParamSegment("m", "p", ids("ab"), (4, 5)),  # the placeholder's first positions
        ModuleSegment("#1"),                      # precedes k in the document: emitted right after m
        TextSegment(ids("mid"), (11, 12, 13)),    # frontier: one past #1 (10)
        ModuleSegment("k"),
        ModuleSegment("#2"),                      # trailing schema text right after the last import
        TextSegment(ids("tail"), span(18, 22)),
    ]


def test_plan_text_at_start_without_leading_anonymous() -> None:
    lay = layout(schema("s", module("a", "xyz"), "Q"), enc, placeholder_id=PH)
    segs = plan(lay, '<prompt schema="s">hi<a/>yo</prompt>')
    assert segs == [TextSegment(ids("hi"), (0, 1)), ModuleSegment("a"), ModuleSegment("#0"),
                    TextSegment(ids("yo"), (4, 5))]


def test_plan_nested_union_and_frontier(lay: SchemaLayout) -> None:
    p = lay.prompt_plan(prompt_from_str('<prompt schema="s"><m>x<n/>y</m><u1/>w<k/></prompt>'), enc)
    assert list(p.segments) == [
        ModuleSegment("#0"),
        ModuleSegment("m"),
        TextSegment(ids("x"), (8,)),          # after m's own tokens (2..7)
        ModuleSegment("n"),
        TextSegment(ids("y"), (10,)),         # after n (8..9)
        ModuleSegment("#1"),                  # #1 at 10: shares a position with "y" (paper's rule)
        ModuleSegment("u1"),
        TextSegment(ids("w"), (12,)),
        ModuleSegment("k"),
        ModuleSegment("#2"),
    ]
    assert p.end == 18 and p.scaffolds == ("mk",)


def test_plan_out_of_document_order_imports(lay: SchemaLayout) -> None:
    segs = plan(lay, '<prompt schema="s"><k/>a<m/>b</prompt>')
    assert segs == [ModuleSegment("#0"), ModuleSegment("#1"), ModuleSegment("k"),
                    TextSegment(ids("a"), (15,)), ModuleSegment("m"), ModuleSegment("#2"),
                    TextSegment(ids("b"), (18,))]


def test_plan_prompt_roles_are_new_text() -> None:
    s = schema("s", module("a", "xyz"))
    lay = layout(s, enc, placeholder_id=PH, role_text=chatml)
    p = Prompt("s", (Role("user", (Import("a"), Text("q"))),))
    assert list(lay.prompt_plan(p, enc).segments) == [
        TextSegment(ids("<u>"), (0, 1, 2)), ModuleSegment("a"), TextSegment(ids("q"), (3,)),
        TextSegment(ids("</>"), (4, 5, 6))]


def test_plan_param_values(lay: SchemaLayout) -> None:
    assert plan(lay, '<prompt schema="s"><m p="abc"/></prompt>')[2] == ParamSegment("m", "p", ids("abc"), (4, 5, 6))
    # An empty value (or none) leaves the placeholder: no segment.
    assert ParamSegment not in map(type, plan(lay, '<prompt schema="s"><m p=""/></prompt>'))
    with pytest.raises(SchemaError, match="^parameter p of module m takes at most 3 tokens, got 4$"):
        plan(lay, '<prompt schema="s"><m p="abcd"/></prompt>')


def test_plan_checks_prompt(lay: SchemaLayout) -> None:
    with pytest.raises(SchemaError, match="members of the same union"):
        plan(lay, '<prompt schema="s"><u1/><u2/></prompt>')
    with pytest.raises(SchemaError, match="nested in 'm'"):
        plan(lay, '<prompt schema="s"><n/></prompt>')


def test_plan_wrong_schema_and_limits_carried() -> None:
    s = schema("s", *(module(f"m{i}", "x") for i in range(12)), limits=Limits(max_modules=12))
    with pytest.raises(SchemaError, match="more than 5 modules"):
        layout(s, enc, placeholder_id=PH, limits=Limits(max_modules=5))
    lay = layout(s, enc, placeholder_id=PH, limits=Limits(max_modules=12))
    assert lay.limits == Limits(max_modules=12)
    assert list(lay.prompt_plan(Prompt("s", (Import("m11"),)), enc).segments) == [ModuleSegment("m11")]
    with pytest.raises(SchemaError, match="written against schema 't', not 's'"):
        lay.prompt_plan(Prompt("t", (Import("m1"),)), enc)
    with pytest.raises(TypeError, match="placeholder_id must be an int"):
        layout(s, enc, placeholder_id=None, limits=Limits(max_modules=12))  # type: ignore[arg-type]
