"""PML: parsing, the text rule, validation of hostile/invalid documents, prompts, JSON, serialization."""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixrelay.modules.pml import (
    Import,
    Limits,
    Module,
    Param,
    Prompt,
    Role,
    Scaffold,
    Schema,
    SchemaError,
    Text,
    Union,
    check_prompt,
    is_blank,
    merge_text,
    module_index,
    parse_schema,
    prompt_from_json,
    prompt_from_str,
    prompt_to_json,
    prompt_to_pml,
    to_pml,
    validate,
    validate_prompt,
)

CITIES = """<schema name="cities">
  <system>You are a travel guide.</system>
  <module name="city-info">Facts about cities.</module>
  <module name="trip-plan">Plan a trip of <param name="duration" len="2"/> days.
     <module name="budget">Keep it cheap.</module>
  </module>
  <union>
    <module name="tokyo">Tokyo is ...</module>
    <module name="miami">Miami is ...</module>
  </union>
  <scaffold name="both" modules="city-info trip-plan"/>
</schema>"""


def cities() -> Schema:
    return parse_schema(CITIES)


def bad(doc: str | bytes, match: str, limits: Limits | None = None) -> SchemaError:
    with pytest.raises(SchemaError, match=match) as info:
        parse_schema(doc, limits)
    return info.value


def wrap(body: str) -> str:
    return f'<schema name="s">{body}</schema>'


# ─────────────────────────────────────────────────────────────── valid constructs


def test_parse_full_example() -> None:
    assert cities() == Schema(
        "cities",
        (
            Role("system", (Text("You are a travel guide."),)),
            Module("city-info", (Text("Facts about cities."),)),
            Module("trip-plan", (
                Text("Plan a trip of "),
                Param("duration", 2),
                Text(" days.\n     "),
                Module("budget", (Text("Keep it cheap."),)),
            )),
            Union((Module("tokyo", (Text("Tokyo is ..."),)), Module("miami", (Text("Miami is ..."),)))),
        ),
        (Scaffold("both", ("city-info", "trip-plan")),),
    )


def test_lines_recorded_but_not_compared() -> None:
    s = cities()
    assert s.children[1].line == 3 and s.children[2].children[1].line == 4
    assert s.scaffolds[0].line == 11
    assert Module("m", (), line=7) == Module("m", (), line=None)


def test_text_rule_tail_whitespace_comments_cdata_refs() -> None:
    s = parse_schema(wrap('  <module name="m">a<!-- c -->b<![CDATA[<x>&]]>&amp;&lt;&#65;&#13;</module> tail '
                          '<module name="n">\n\t </module>\n'))
    # Text runs are verbatim; comments do not split them; tail text is kept; blank runs dropped.
    assert s.children == (Module("m", (Text("ab<x>&&<A\r"),)), Text(" tail "), Module("n", ()))


def test_text_merged_across_scaffold() -> None:
    s = parse_schema(wrap('<module name="a"/><module name="b"/>x<scaffold name="sc" modules="a b"/>y'
                          '  <scaffold name="sd" modules="b a"/>  '))
    # "y  " is one run (not blank), kept verbatim; merged with "x" across the scaffold.
    assert s.children == (Module("a", ()), Module("b", ()), Text("xy  "))
    assert [sc.name for sc in s.scaffolds] == ["sc", "sd"]


def test_roles_hold_modules_and_modules_hold_roles() -> None:
    s = parse_schema(wrap('<user>Q: <module name="q">about <param name="t" len="3"/></module></user>'
                          '<module name="shot"><user>2+2?</user><assistant>4</assistant></module>'))
    assert s.children == (
        Role("user", (Text("Q: "), Module("q", (Text("about "), Param("t", 3))))),
        Module("shot", (Role("user", (Text("2+2?"),)), Role("assistant", (Text("4"),)))),
    )


def test_nested_union_inside_module_and_same_param_name_in_two_modules() -> None:
    s = parse_schema(wrap('<module name="a"><param name="x" len="1"/><union><module name="b">'
                          '<param name="x" len="4"/></module><module name="c"/></union></module>'))
    index = module_index(s)
    assert list(index) == ["a", "b", "c"]
    assert index["b"].parent == "a" and index["b"].union == 0 and index["c"].union == 0
    assert index["a"].params == ("x",) and index["b"].params == ("x",)


def test_bytes_input_utf8_and_bom() -> None:
    doc = wrap('<module name="m">caf\u00e9 \U0001f600</module>').encode()
    assert parse_schema(doc) == parse_schema(b"\xef\xbb\xbf" + doc)
    assert parse_schema(doc).children[0].children == (Text("caf\u00e9 \U0001f600"),)


def test_xml_declaration_encoding_is_ignored_for_str() -> None:
    s = parse_schema('<?xml version="1.0" encoding="latin-1"?>' + wrap('<module name="m">\u00e9</module>'))
    assert s.children[0].children == (Text("\u00e9"),)


def test_single_member_union_and_empty_module_and_role_are_valid() -> None:
    s = parse_schema(wrap('<union><module name="only"/></union><system/>'))
    assert s.children == (Union((Module("only", ()),)), Role("system", ()))


def test_merge_text_and_is_blank() -> None:
    assert is_blank(" \t\r\n") and not is_blank("\u00a0")  # only XML whitespace is blank
    assert merge_text(["a", " ", Text("b"), Module("m", ()), "\n", "c"]) == (Text("ab"), Module("m", ()), Text("c"))


# ─────────────────────────────────────────────────────────────── hostile documents

BILLION_LAUGHS = """<?xml version="1.0"?>
<!DOCTYPE lolz [
 <!ENTITY lol "lol">
 <!ENTITY lol2 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">
 <!ENTITY lol3 "&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;">
 <!ENTITY lol4 "&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;">
 <!ENTITY lol9 "&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;">
]>
<schema name="s"><module name="m">&lol9;</module></schema>"""


@pytest.mark.parametrize("doc", [
    BILLION_LAUGHS,
    '<!DOCTYPE schema><schema name="s"/>',
    '<!DOCTYPE schema SYSTEM "http://example.com/evil.dtd"><schema name="s"/>',
    '<!DOCTYPE s [<!ENTITY x SYSTEM "file:///etc/passwd">]><schema name="s">&x;</schema>',
    '<!DOCTYPE s [<!ENTITY % p SYSTEM "http://example.com/p.dtd"> %p;]><schema name="s"/>',
])
def test_dtds_and_entities_rejected(doc: str) -> None:
    bad(doc, r"DTDs \(<!DOCTYPE \.\.\.>\) are not allowed")


def test_undefined_entity_is_malformed() -> None:
    bad(wrap('<module name="m">&x;</module>'), r"malformed XML: undefined entity: line 1")


def test_deep_nesting_is_cut_off_fast() -> None:
    n = 100_000
    doc = '<schema name="s">' + '<module name="m">' * n + '</module>' * n + '</schema>'
    t0 = time.perf_counter()
    bad(doc, r"<module> \(line 1\): nested deeper than 32 elements")
    assert time.perf_counter() - t0 < 1.0


def test_depth_limit_is_exact() -> None:
    def doc(depth: int) -> str:  # schema + (depth - 1) modules
        inner = "".join(f'<module name="m{i}">' for i in range(depth - 1))
        return '<schema name="s">' + inner + "x" + "</module>" * (depth - 1) + "</schema>"
    parse_schema(doc(32))
    bad(doc(33), "nested deeper than 32")
    parse_schema(doc(5), Limits(max_depth=5))
    bad(doc(6), "nested deeper than 5", Limits(max_depth=5))


def test_too_many_elements() -> None:
    doc = wrap("".join(f'<module name="m{i}"/>' for i in range(20_000)))
    bad(doc, r"<module> \(line 1\): more than 20000 elements", Limits(max_modules=20_000))
    parse_schema(wrap("".join(f'<module name="m{i}"/>' for i in range(19_999))), Limits(max_modules=20_000))


def test_too_many_modules() -> None:
    doc = wrap("".join(f'<module name="m{i}"/>' for i in range(11)))
    bad(doc, r"<module name='m10'> \(line 1\): more than 10 modules", Limits(max_modules=10))


def test_size_checked_before_parsing() -> None:
    # Not even well-formed: only the size check can have produced this message.
    junk = "<" * (4 * 1024 * 1024 + 1)
    bad(junk, "more than the limit of 4194304 bytes")
    bad(junk.encode(), r"document is 4194305 bytes, more than the limit of 4194304")
    # The UTF-8 size counts, not characters: 2-byte characters over a small limit.
    bad(wrap("\u00e9" * 60), r"document is \d+ bytes, more than the limit of 100", Limits(max_bytes=100))


def test_non_utf8_and_surrogates() -> None:
    bad(wrap('<module name="m">caf\u00e9</module>').encode("latin-1"), r"not valid UTF-8 \(byte 37\)")
    bad(wrap("\ud800"), "lone surrogate")
    bad(123, "must be str or bytes")  # type: ignore[arg-type]


@pytest.mark.parametrize("doc, match", [
    ("", r"malformed XML: no element found: line 1, column 0"),
    ('<schema name="s">', "malformed XML: no element found"),
    ('<schema name="s">\n<module name="m"></schema>', r"malformed XML: mismatched tag: line 2"),
    (wrap("\x01"), "malformed XML: not well-formed"),
    ('<prompt schema="s"/>', r"<prompt> \(line 1\): a schema document's root must be <schema>"),
    ("<schema/>", r"<schema> \(line 1\): missing attribute 'name'"),
    ('<schema name="s" version="2"/>', r"<schema> \(line 1\): unknown attribute 'version'"),
    (wrap('\n<modul name="m"/>'), r"<modul> \(line 2\): unknown element inside <schema>"),
    (wrap('<module name="m" id="1"/>'), r"<module> \(line 1\): unknown attribute 'id'"),
    (wrap("<module/>"), r"<module> \(line 1\): missing attribute 'name'"),
    (wrap('<module name="m"><param name="p"/></module>'), r"<param> \(line 1\): missing attribute 'len'"),
    (wrap('<module name="m"><param name="p" len="1">x</param></module>'), r"<param> \(line 1\) must be empty"),
    (wrap('<user role="x"/>'), r"<user> \(line 1\): unknown attribute 'role'"),
    (wrap('<union name="u"><module name="m"/></union>'), r"<union> \(line 1\): unknown attribute 'name'"),
    (wrap('<x:module xmlns:x="urn:x" name="m"/>'), r"<\{urn:x\}module> \(line 1\): unknown element"),
    (wrap('<module xmlns="urn:x" name="m"/>'), r"unknown element"),
])
def test_malformed_and_unknown(doc: str, match: str) -> None:
    bad(doc, match)


@pytest.mark.parametrize("value, match", [
    ("0", r"<param name='p'> \(line 1\) in <module name='m'> \(line 1\): len must be an integer from 1 to "
          r"4096, got 0"),
    ("-3", r"len must be an integer from 1 to 4096, got -3"),
    ("4097", r"len must be an integer from 1 to 4096, got 4097"),
    ("99999999999999999999999", r"len is too large, got '99999999999999999999999'"),
    ("9" * 10_000, r"len is too large"),
    ("abc", r"len must be an integer, got 'abc'"),
    ("2.5", r"len must be an integer, got '2.5'"),
    (" 2", r"len must be an integer, got ' 2'"),
    ("+2", r"len must be an integer, got '\+2'"),
    ("", r"len must be an integer, got ''"),
    ("\u0662", r"len must be an integer"),  # Arabic-Indic two: int() would take it
])
def test_param_len(value: str, match: str) -> None:
    bad(wrap(f'<module name="m"><param name="p" len="{value}"/></module>'), match)


def test_param_len_limit_configurable() -> None:
    doc = wrap('<module name="m"><param name="p" len="8"/></module>')
    bad(doc, "from 1 to 7, got 8", Limits(max_param_len=7))
    assert parse_schema(doc, Limits(max_param_len=8)).children[0].children == (Param("p", 8),)


@pytest.mark.parametrize("body, match", [
    ('<module name="a"/>\n<module name="a"/>',
     r"<module name='a'> \(line 2\): duplicate module name 'a'; module names are global within a schema "
     r"\(first defined at line 1\)"),
    ('<module name="a"><module name="a"/></module>', "duplicate module name 'a'"),
    ('<module name="a"/><union><module name="b"/><module name="a"/></union>', "duplicate module name 'a'"),
    ('<module name="m"><param name="p" len="1"/>\n<param name="p" len="2"/></module>',
     r"<param name='p'> \(line 2\): duplicate param name 'p' in <module name='m'> \(line 1\) "
     r"\(first defined at line 1\)"),
    ('<module name="m"><user><param name="p" len="1"/></user><param name="p" len="1"/></module>',
     "duplicate param name 'p'"),
    ("<union>\n</union>", r"<union> \(line 1\) in <schema name='s'>: a union needs at least one <module> member"),
    ('<union>text<module name="m"/></union>', r"<union> \(line 1\): only <module> elements are allowed inside "
                                              r"<union>, got text 'text'"),
    ('<union><module name="m"/><param name="p" len="1"/></union>', r"got <param> \(line 1\)"),
    ('<union><user/></union>', "got <user>"),
    ('<union><union/></union>', "got <union>"),
    ("<user>\n<system>x</system></user>",
     r"<system> \(line 2\) in <user> \(line 1\) in <schema name='s'>: roles cannot be nested"),
    ('<user><module name="m"><assistant>x</assistant></module></user>', "roles cannot be nested"),
    ('<param name="p" len="1"/>', r"<param name='p'> \(line 1\) in <schema name='s'>: <param> is only allowed "
                                  r"inside a <module>"),
    ('<system>x <param name="p" len="1"/></system>', "<param> is only allowed inside a <module>"),
    ('<module name="m"><scaffold name="x" modules="a b"/></module>',
     r"<scaffold> \(line 1\): allowed only directly inside <schema>, not inside <module>"),
    ('<module name="a"/><scaffold name="sc" modules="a b"/>', r"<scaffold name='sc'> \(line 1\): unknown module 'b'"),
    ('<module name="a"/><scaffold name="sc" modules="a"/>', "a scaffold needs at least 2 modules, got 1"),
    ('<module name="a"/><scaffold name="sc" modules=""/>', "a scaffold needs at least 2 modules, got 0"),
    ('<module name="a"/><scaffold name="sc" modules="a a"/>', "module 'a' is listed twice"),
    ('<module name="a"/><module name="b"/><scaffold name="x" modules="a b"/><scaffold name="x" modules="b a"/>',
     "duplicate scaffold name 'x'"),
    ('<module name="a"/><scaffold name="x" modules="a b">t</scaffold>', r"<scaffold> \(line 1\) must be empty"),
    ('<union><module name="a"><module name="a1"/></module><module name="b"/></union>'
     '<scaffold name="x" modules="a1 b"/>', "modules 'a1' and 'b' are in different members of one union"),
    ('<module name="1m"/>', r"<module name='1m'> \(line 1\): invalid name '1m' \(names match"),
    ('<module name="a b"/>', "invalid name 'a b'"),
    ('<module name=""/>', "invalid name ''"),
    ('<module name="caf\u00e9"/>', "invalid name"),
    ('<module name="user"/>', "module name 'user' is reserved for the role tag"),
    ('<module name="m"><param name="xmlns" len="1"/></module>', "name 'xmlns' is reserved by XML"),
    ('<module name="m"><param name="p:q" len="1"/></module>', "malformed XML|invalid name"),
    ('<module name="a"/><scaffold name="9" modules="a a"/>', "invalid name '9'"),
])
def test_invalid_structure(body: str, match: str) -> None:
    bad(wrap(body), match)


def test_invalid_schema_name_and_name_length() -> None:
    bad('<schema name="-x"/>', r"<schema name='-x'> \(line 1\): invalid name")
    bad(wrap(f'<module name="{"a" * 129}"/>'), "name is longer than 128 characters")
    parse_schema(wrap(f'<module name="{"a" * 128}"/>'))


def test_errors_are_value_errors_only() -> None:
    assert issubclass(SchemaError, ValueError)


# ─────────────────────────────────────────────────────────────── validate() on hand-made ASTs


# Hand-made ASTs with wrong types on purpose.
@pytest.mark.parametrize("schema, match", [
    (Schema("s", [Text("x")]), r"<schema name='s'>: children must be a tuple, got list"),
    (Schema("s", (Text(" "),)), "whitespace-only Text is not in normal form"),
    (Schema("s", (Text("a"), Text("b"))), "adjacent Text nodes must be merged"),
    (Schema("s", (Text("a\x00"),)), r"character U\+0000 is not allowed in XML text"),
    (Schema("s", (Text("\ufffe"),)), r"character U\+FFFE"),
    (Schema("s", ("x",)), "unexpected child str"),
    (Schema("s", (Module("m", (Param("p", True),)),)), "len must be an integer from 1 to 4096, got True"),
    (Schema("s", (Module("m", (Param("p", "2"),)),)), "got '2'"),
    (Schema("s", (Union((Text("x"),)),)), "union members must be modules, got Text at index 0"),
    (Schema("s", (Role("bot", ()),)), "role 'bot' in <schema name='s'>: roles are system, user, assistant"),
    (Schema(3, ()), "name must be a string, got int"),
    (Schema("s", (), (Scaffold("x", ["a"]),)), "modules must be a tuple"),
    ("schema", "expected a Schema, got str"),
])
def test_validate_hand_made(schema: Schema, match: str) -> None:
    with pytest.raises(SchemaError, match=match):
        validate(schema)


def test_validate_deep_ast_is_iteration_safe() -> None:
    node = Module("leaf", ())
    for i in range(100_000):
        node = Module(f"m{i}", (node,))
    with pytest.raises(SchemaError, match="nested deeper than 32"):
        validate(Schema("s", (node,)))


def test_limits_validated() -> None:
    with pytest.raises(ValueError, match="max_depth: at most 200"):
        Limits(max_depth=1000)
    with pytest.raises(ValueError, match="max_bytes: must be a positive integer"):
        Limits(max_bytes=0)


# ─────────────────────────────────────────────────────────────── prompts


def test_prompt_xml_example() -> None:
    p = prompt_from_str('<prompt schema="cities"><trip-plan duration="3"/><miami/>Highlight the surf spots.</prompt>')
    assert p == Prompt("cities", (Import("trip-plan", (("duration", "3"),)), Import("miami"),
                                  Text("Highlight the surf spots.")))
    check_prompt(p, cities())


def test_prompt_nested_roles_and_text_rule() -> None:
    p = prompt_from_str('<prompt schema="cities">\n  <user>Plan: <trip-plan duration="5 days">'
                        '<budget/> cheap!</trip-plan></user>\n  <assistant>Sure</assistant>\n</prompt>')
    assert p.parts == (
        Role("user", (Text("Plan: "), Import("trip-plan", (("duration", "5 days"),),
                                             (Import("budget"), Text(" cheap!"))))),
        Role("assistant", (Text("Sure"),)),
    )
    check_prompt(p, cities())


def test_missing_param_value_is_allowed() -> None:
    check_prompt(prompt_from_str('<prompt schema="cities"><trip-plan/></prompt>'), cities())


@pytest.mark.parametrize("doc, match", [
    ('<prompt schema="towns"><miami/></prompt>',
     r"<prompt schema='towns'> \(line 1\): written against schema 'towns', not 'cities'"),
    ('<prompt schema="cities">\n<paris/></prompt>', r"import <paris> \(line 2\): unknown module 'paris' in schema"),
    ('<prompt schema="cities"><budget/></prompt>',
     r"module 'budget' is nested in 'trip-plan' and must be imported inside <trip-plan>"),
    ('<prompt schema="cities"><city-info><budget/></city-info></prompt>', "is nested in 'trip-plan'"),
    ('<prompt schema="cities"><trip-plan><miami/></trip-plan></prompt>',
     "module 'miami' is not nested in 'trip-plan'; import it at the top level"),
    ('<prompt schema="cities"><miami/>x<miami/></prompt>', "module 'miami' is imported twice"),
    ('<prompt schema="cities"><tokyo/><user><miami/></user></prompt>',
     "modules 'tokyo' and 'miami' are members of the same union; a prompt imports at most one"),
    ('<prompt schema="cities"><trip-plan days="3"/></prompt>',
     r"module 'trip-plan' has no parameter 'days' \(it has: duration\)"),
    ('<prompt schema="cities"><miami duration="3"/></prompt>',
     "module 'miami' has no parameters, got a value for 'duration'"),
])
def test_check_prompt_errors(doc: str, match: str) -> None:
    with pytest.raises(SchemaError, match=match):
        check_prompt(prompt_from_str(doc), cities())


@pytest.mark.parametrize("doc, match", [
    ('<schema name="cities"/>', "a prompt document's root must be <prompt>"),
    ("<prompt/>", "missing attribute 'schema'"),
    ('<prompt schema="c" x="1"/>', "unknown attribute 'x'"),
    ('<prompt schema="c"><user><system>x</system></user></prompt>', "roles cannot be nested"),
    ('<prompt schema="c"><m><user>x</user></m></prompt>', "roles are not allowed inside an import"),
    ('<prompt schema="c"><user a="1">x</user></prompt>', "unknown attribute 'a'"),
    ('<prompt schema="c"><m xmlns="urn:x"/></prompt>', "XML namespaces are not part of PML"),
    ('<prompt schema="c"><m a="1" a="2"/></prompt>', "malformed XML: duplicate attribute"),
    ('<prompt schema="c"><m xmlns:q="urn:q" q:a="1"/></prompt>', "unknown attribute"),
    ('<prompt schema="c"><\u00e9/></prompt>', r"invalid module name '\u00e9'"),
    ('<!DOCTYPE p><prompt schema="c"/>', "DTDs"),
])
def test_prompt_parse_errors(doc: str, match: str) -> None:
    with pytest.raises(SchemaError, match=match):
        prompt_from_str(doc)


def test_prompt_deep_nesting_cut_off() -> None:
    doc = '<prompt schema="c">' + "<m>" * 100_000 + "</m>" * 100_000 + "</prompt>"
    t0 = time.perf_counter()
    with pytest.raises(SchemaError, match="nested deeper than 32"):
        prompt_from_str(doc)
    assert time.perf_counter() - t0 < 1.0


# ─────────────────────────────────────────────────────────────── JSON prompts


def test_json_prompt_matches_xml() -> None:
    obj = {"schema": "cities", "parts": [
        {"role": "user", "parts": [
            {"module": "trip-plan", "args": {"duration": "3"}, "parts": [{"module": "budget"}]},
            {"text": "  "},
            {"module": "miami"},
        ]},
        {"text": "Highlight "}, {"text": "the surf spots."},
    ]}
    p = prompt_from_json(obj)
    assert p == prompt_from_str('<prompt schema="cities"><user><trip-plan duration="3"><budget/></trip-plan> '
                                '<miami/></user>Highlight the surf spots.</prompt>')
    assert prompt_from_json(prompt_to_json(p)) == p
    check_prompt(p, cities())


@pytest.mark.parametrize("obj, match", [
    ([], "prompt: expected a JSON object, got list"),
    ({"schema": "c"}, "prompt: missing key 'parts'"),
    ({"schema": 1, "parts": []}, r"prompt.schema: expected a string"),
    ({"schema": "c", "parts": [], "x": 1}, "prompt: unknown key 'x'"),
    ({"schema": "c", "parts": {}}, r"parts: expected a list, got dict"),
    ({"schema": "c", "parts": ["text"]}, r"parts\[0\]: expected an object, got str"),
    ({"schema": "c", "parts": [{}]}, r"parts\[0\]: expected exactly one of 'module', 'text', 'role', got \[\]"),
    ({"schema": "c", "parts": [{"text": "a", "module": "m"}]}, "expected exactly one of"),
    ({"schema": "c", "parts": [{"text": 5}]}, r"parts\[0\].text: expected a string, got int"),
    ({"schema": "c", "parts": [{"text": "a", "parts": []}]}, "unknown key 'parts' in a text part"),
    ({"schema": "c", "parts": [{"module": "m", "args": []}]}, r"parts\[0\].args: expected an object, got list"),
    ({"schema": "c", "parts": [{"module": "m", "args": {"d": 3}}]}, r"parts\[0\].args.d: expected a string, got int"),
    ({"schema": "c", "parts": [{"module": "m", "args": {"bad name": "3"}}]}, "invalid param name 'bad name'"),
    ({"schema": "c", "parts": [{"module": "m", "parts": "x"}]}, r"parts\[0\].parts: expected a list"),
    ({"schema": "c", "parts": [{"role": "bot", "parts": []}]}, r"parts\[0\].role: expected one of system"),
    ({"schema": "c", "parts": [{"role": "user", "parts": [{"role": "user", "parts": []}]}]},
     "roles cannot be nested"),
    ({"schema": "c", "parts": [{"module": "1x"}]}, "invalid module name '1x'"),
    ({"schema": "c", "parts": [{"text": "a\x00"}]}, r"character U\+0000"),
    ({"schema": "c", "parts": [{"module": "m", "args": {"d": "\x07"}}]}, r"value of param 'd': character U\+0007"),
])
def test_json_bad_shapes(obj: object, match: str) -> None:
    with pytest.raises(SchemaError, match=match):
        prompt_from_json(obj)


def test_json_deep_and_wide() -> None:
    obj: dict = {"module": "m"}
    for _ in range(100_000):
        obj = {"module": "m", "parts": [obj]}
    with pytest.raises(SchemaError, match="nested deeper than 32 levels"):
        prompt_from_json({"schema": "c", "parts": [obj]})
    with pytest.raises(SchemaError, match="more than 20000 parts"):
        prompt_from_json({"schema": "c", "parts": [{"text": "x"}] * 20_001})


def test_validate_prompt_hand_made() -> None:
    with pytest.raises(SchemaError, match="param 'd' given twice"):
        validate_prompt(Prompt("c", (Import("m", (("d", "1"), ("d", "2"))),)))
    with pytest.raises(SchemaError, match="args must be \\(name, value\\) pairs"):
        validate_prompt(Prompt("c", (Import("m", (("d",),)),)))  # type: ignore[arg-type]
    with pytest.raises(SchemaError, match="unexpected part Module"):
        validate_prompt(Prompt("c", (Module("m", ()),)))  # type: ignore[arg-type]


# ─────────────────────────────────────────────────────────────── serialization


def test_to_pml_layout_and_escaping() -> None:
    s = Schema("s", (Text('a<b>&"c"\r\n'), Module("m", (Param("p", 2), Text("x ]]> y"))), Union((Module("u", ()),))),
               (Scaffold("sc", ("m", "u")),))
    out = to_pml(s)
    assert out == ('<schema name="s">a&lt;b&gt;&amp;"c"&#13;\n<module name="m">\n    <param name="p" len="2"/>'
                   'x ]]&gt; y</module>\n  <union>\n    <module name="u"/>\n  </union>\n'
                   '  <scaffold name="sc" modules="m u"/>\n</schema>')
    assert parse_schema(out) == s
    assert parse_schema(to_pml(s, indent=None)) == s


def test_to_pml_validates() -> None:
    with pytest.raises(SchemaError, match="adjacent Text"):
        to_pml(Schema("s", (Text("a"), Text("b"))))


def test_prompt_to_pml_escapes_attribute_values() -> None:
    p = Prompt("c", (Import("m", (("v", 'a"b\t\n\r<&>'),)), Text("t\r")))
    out = prompt_to_pml(p)
    assert out == '<prompt schema="c"><m v="a&quot;b&#9;&#10;&#13;&lt;&amp;&gt;"/>t&#13;</prompt>'
    assert prompt_from_str(out) == p


# ─────────────────────────────────────────────────────────────── round-trip properties

_chars = st.one_of(
    st.sampled_from(list("<>&\"' \t\r\n]]ab;")),
    st.characters(min_codepoint=0x20, max_codepoint=0x2FF),
    st.characters(min_codepoint=0x10000, max_codepoint=0x1F64F),
)
_texts = st.text(_chars, min_size=1, max_size=12)
_names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.-]{0,6}", fullmatch=True).filter(
    lambda n: n not in ("system", "user", "assistant", "xmlns"))


@st.composite
def schemas(draw: st.DrawFn) -> Schema:
    counter = iter(range(10_000))

    def fresh() -> str:
        return f"m{next(counter)}"

    def children(depth: int, in_module: bool, in_role: bool) -> tuple:
        out: list[object] = []
        for _ in range(draw(st.integers(0, 4 if depth < 3 else 1))):
            kinds = ["text", "module"] + (["union"] if depth < 3 else [])
            kinds += ["param"] if in_module else []
            kinds += ["role"] if not in_role and depth < 3 else []
            kind = draw(st.sampled_from(kinds))
            if kind == "text":
                out.append(draw(_texts))
            elif kind == "param":
                out.append(Param(fresh(), draw(st.integers(1, 8))))
            elif kind == "module" or depth >= 3:
                out.append(Module(fresh(), children(depth + 1, True, in_role)))
            elif kind == "union":
                n = draw(st.integers(1, 3))
                out.append(Union(tuple(Module(fresh(), children(depth + 2, True, in_role)) for _ in range(n))))
            else:
                out.append(Role(draw(st.sampled_from(["system", "user", "assistant"])),
                                children(depth + 1, in_module, True)))
        return merge_text(out)

    body = children(1, False, False)
    top = [n.name for n in body if isinstance(n, Module)]
    scaffolds = ()
    if len(top) >= 2:
        scaffolds = (Scaffold(draw(_names), tuple(top[:2])),)
    return Schema(draw(_names), body, scaffolds)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schemas(), st.sampled_from(["  ", None, "\t"]))
def test_schema_round_trip(schema: Schema, indent: str | None) -> None:
    validate(schema)
    assert parse_schema(to_pml(schema, indent=indent)) == schema


@st.composite
def prompts(draw: st.DrawFn) -> Prompt:
    def parts(depth: int, in_role: bool, in_import: bool) -> tuple:
        out: list[object] = []
        for _ in range(draw(st.integers(0, 3))):
            kind = draw(st.sampled_from(["text", "import"] + (["role"] if not in_role and not in_import else [])))
            if kind == "text":
                out.append(draw(_texts))
            elif kind == "import" and depth < 4:
                keys = draw(st.lists(_names, max_size=3, unique=True))
                args = tuple((k, draw(st.text(_chars, max_size=6))) for k in keys)
                out.append(Import(draw(_names), args, parts(depth + 1, in_role, True)))
            elif kind == "role":
                out.append(Role(draw(st.sampled_from(["system", "user", "assistant"])), parts(depth + 1, True, False)))
        return merge_text(out)

    return Prompt(draw(_names), parts(2, False, False))


@settings(max_examples=150, deadline=None)
@given(prompts())
def test_prompt_round_trip(prompt: Prompt) -> None:
    assert prompt_from_str(prompt_to_pml(prompt)) == prompt
    assert prompt_from_json(prompt_to_json(prompt)) == prompt
