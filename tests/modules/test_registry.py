"""SchemaRegistry on the default model's tokenizer: registration, identity, limits, composing prompts
(PML, JSON, chat messages) and the tokenizer helpers (placeholder, chat markers)."""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass

import pytest

from radixrelay.modules.builder import module, param, scaffold, schema, union
from radixrelay.modules.compose import KEY_SEP, positions_of
from radixrelay.modules.pml import Import, Limits, Prompt, SchemaError, Text, parse_schema, to_pml
from radixrelay.modules.registry import (
    ModuleSummary, ParamInfo, ScaffoldSummary, SchemaRegistry, UnknownSchemaError, chat_generation_prompt,
    chat_role_text, placeholder_token, prompt_from_messages, schema_digest,
)
from radixrelay.text.tokenizer import Tokenizer, load_tokenizer
from tests.text.test_tokenizer import default_gguf

PAGE = 16
DOCS = """<schema name="docs">
  <system>You answer questions about the documents.</system>
  <module name="intro">Here are some documents.</module>
  <module name="greet">Dear <param name="who" len="4"/>, welcome.</module>
  <union>
    <module name="doc-a">Alpha is a small town by the sea.</module>
    <module name="doc-b">Beta is a large city in the mountains, famous for its bridges.</module>
  </union>
  <module name="doc-c">Gamma makes cheese.</module>
  <scaffold name="ac" modules="doc-a doc-c"/>
</schema>"""


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer(default_gguf())


@pytest.fixture()
def reg(tok: Tokenizer) -> SchemaRegistry:
    return SchemaRegistry.for_tokenizer(tok, model_id="smollm2", page_size=PAGE)


def enc(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


# -- tokenizer helpers ----------------------------------------------------------------------------


def test_placeholder_is_the_space_token(tok: Tokenizer) -> None:
    assert placeholder_token(tok) == enc(tok, " ")[0] and len(enc(tok, " ")) == 1


@dataclass
class FakeTok:
    table: dict[str, list[int]]
    eos_token_id: int | None = 2
    chat_template: str | None = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.table.get(text, [7, 7]))


def test_placeholder_fallbacks() -> None:
    assert placeholder_token(FakeTok({" ": [5, 6], "\n": [9]})) == 9
    assert placeholder_token(FakeTok({" ": [], "\n": [3, 4]})) == 2
    with pytest.raises(ValueError, match="no placeholder"):
        placeholder_token(FakeTok({}, eos_token_id=None))


def test_chat_markers_of_chatml(tok: Tokenizer) -> None:
    assert chat_role_text(tok) == {role: (f"<|im_start|>{role}\n", "<|im_end|>\n")
                                   for role in ("system", "user", "assistant")}
    assert chat_generation_prompt(tok) == "<|im_start|>assistant\n"


def test_chat_markers_without_template(tok: Tokenizer) -> None:
    assert chat_role_text(FakeTok({})) is None and chat_generation_prompt(FakeTok({})) is None
    refuses_system = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}"
                      "{% endif %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}")
    assert chat_role_text(tok, refuses_system) is None
    plain = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</>{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
    assert chat_role_text(tok, plain) == {r: (f"<{r}>", "</>") for r in ("system", "user", "assistant")}
    assert chat_generation_prompt(tok, plain) == "<a>"
    # Messages that do not render one after another cannot give per-role markers.
    reverse = "{% for m in messages|reverse %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    assert chat_role_text(tok, reverse) is None
    drops_system = "{% for m in messages %}{% if m['role'] != 'system' %}[{{ m['content'] }}]{% endif %}{% endfor %}"
    assert chat_role_text(tok, drops_system) is None


# -- registration ---------------------------------------------------------------------------------


def test_register_reports_the_layout(reg: SchemaRegistry, tok: Tokenizer) -> None:
    info = reg.register(DOCS)
    assert (info.object, info.name, info.model) == ("schema", "docs", "smollm2")
    assert info.digest == schema_digest("smollm2", parse_schema(DOCS))
    assert [m.name for m in info.modules] == ["intro", "greet", "doc-a", "doc-b", "doc-c"]
    system = len(enc(tok, "<|im_start|>system\n") + enc(tok, "You answer questions about the documents.")
                 + enc(tok, "<|im_end|>\n"))
    intro = len(enc(tok, "Here are some documents."))
    greet = len(enc(tok, "Dear ")) + 4 + len(enc(tok, ", welcome."))
    a, b = len(enc(tok, "Alpha is a small town by the sea.")), \
        len(enc(tok, "Beta is a large city in the mountains, famous for its bridges."))
    c = len(enc(tok, "Gamma makes cheese."))
    start = system + intro + greet
    assert info.modules[0] == ModuleSummary("intro", system, system + intro, intro, [])
    assert info.modules[1].params == [ParamInfo("who", 4)] and info.modules[1].num_tokens == greet
    assert (info.modules[2].start, info.modules[2].end, info.modules[2].union) == (start, start + a, 0)
    assert (info.modules[3].start, info.modules[3].end, info.modules[3].union) == (start, start + b, 0)
    assert (info.modules[4].start, info.modules[4].end) == (start + b, start + b + c)
    assert info.scaffolds == [ScaffoldSummary("ac", ["doc-a", "doc-c"])]
    assert info.end_position == start + b + c
    assert info.num_tokens == system + intro + greet + a + b + c


def test_digest_is_content_and_model(reg: SchemaRegistry) -> None:
    s = parse_schema(DOCS)
    canonical = to_pml(s, indent=None)
    expected = hashlib.sha256()
    for part in ("smollm2", canonical):
        expected.update(len(part.encode()).to_bytes(8, "little") + part.encode())
    assert schema_digest("smollm2", s) == expected.hexdigest()
    # Layout whitespace is not content; the builder's tree is the parser's tree.
    assert schema_digest("smollm2", parse_schema(to_pml(s, indent="    "))) == schema_digest("smollm2", s)
    built = schema("t", module("m", "x ", param("p", 2)))
    assert schema_digest("m1", built) == schema_digest("m1", parse_schema('<schema name="t"><module name="m">x <param name="p" len="2"/></module></schema>'))
    assert schema_digest("m2", built) != schema_digest("m1", built)
    assert reg.register(built).digest == schema_digest("smollm2", built)


def test_reregister_same_is_idempotent_different_replaces(reg: SchemaRegistry) -> None:
    first = reg.register(DOCS)
    assert reg.register(DOCS.replace("\n  ", "\n      ")) is first     # same content, other layout
    changed = reg.register(DOCS.replace("Gamma makes cheese.", "Gamma makes wine."))
    assert changed.digest != first.digest and reg.get("docs") is changed
    assert [i.name for i in reg.list()] == ["docs"]


def test_get_list_delete(reg: SchemaRegistry) -> None:
    reg.register(DOCS)
    reg.register('<schema name="a-first"><module name="m">hi</module></schema>')
    assert [i.name for i in reg.list()] == ["a-first", "docs"]
    assert reg.delete("a-first") is True and reg.delete("a-first") is False
    with pytest.raises(UnknownSchemaError, match="'a-first' is not registered") as err:
        reg.get("a-first")
    assert isinstance(err.value, SchemaError) and err.value.name == "a-first"


def test_invalid_and_hostile_schemas_are_schema_errors(reg: SchemaRegistry) -> None:
    laughs = ('<?xml version="1.0"?><!DOCTYPE lolz [<!ENTITY lol "lol"><!ENTITY lol2 "&lol;&lol;">]>'
              '<schema name="x"><module name="m">&lol2;</module></schema>')
    for bad in (laughs, "<schema name='x'><module>no name</module></schema>", "not xml",
                '<schema name="x"><module name="m"><param name="p" len="999999999"/></module></schema>'):
        with pytest.raises(SchemaError):
            reg.register(bad)
    assert reg.list() == []


def test_limits_on_schemas_and_tokens(tok: Tokenizer) -> None:
    reg = SchemaRegistry.for_tokenizer(tok, model_id="m", page_size=PAGE, max_schemas=2, max_tokens=40)
    reg.register('<schema name="a"><module name="m">one</module></schema>')
    reg.register('<schema name="b"><module name="m">two</module></schema>')
    with pytest.raises(SchemaError, match="most this server holds"):
        reg.register('<schema name="c"><module name="m">three</module></schema>')
    reg.register('<schema name="b"><module name="m">two again</module></schema>')   # a replacement fits
    reg.delete("a")
    with pytest.raises(SchemaError, match="exceed the 40 tokens"):
        reg.register('<schema name="c"><module name="m">' + "word " * 60 + "</module></schema>")
    assert [i.name for i in reg.list()] == ["b"]


def test_concurrent_registrations_respect_the_limit(tok: Tokenizer) -> None:
    reg = SchemaRegistry.for_tokenizer(tok, model_id="m", page_size=PAGE, max_schemas=3)
    errors: list[Exception] = []

    def one(i: int) -> None:
        try:
            reg.register(f'<schema name="s{i}"><module name="m">text {i}</module></schema>')
        except SchemaError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(reg.list()) == 3 and len(errors) == 5


# -- composing prompts ----------------------------------------------------------------------------


def test_prefix_only_prompt_is_the_plain_token_sequence(reg: SchemaRegistry, tok: Tokenizer) -> None:
    reg.register('<schema name="p"><module name="first">You are a helpful assistant.</module>'
                 '<module name="second">Unused.</module></schema>')
    out = reg.compose("p", '<prompt schema="p"><first/> What is 2+2?</prompt>')
    assert not out.is_modular and out.rope_runs == [] and out.module_tokens == 0
    assert out.token_ids == enc(tok, "You are a helpful assistant.") + enc(tok, " What is 2+2?")
    assert out.end_position == len(out.token_ids)


def test_modular_prompt_spans_keys_and_positions(reg: SchemaRegistry, tok: Tokenizer) -> None:
    info = reg.register(DOCS)
    out = reg.compose("docs", '<prompt schema="docs"><doc-c/><greet who="Ann"/>Who makes cheese?</prompt>')
    assert out.is_modular
    names = [m.key.split(KEY_SEP) for m in out.modules]
    assert all(salt == "" and digest == info.digest for salt, _, digest, _ in names)
    assert {(kind, name) for _, kind, _, name in names} >= {("module", "doc-c"), ("module", "greet")}
    for span in out.modules:
        assert len(span.token_ids) % PAGE == 0 and span.num_real <= len(span.token_ids)
        assert set(span.token_ids[span.num_real:]) <= {reg.placeholder_id}
    greet = next(m for m in out.modules if m.key.endswith("greet"))
    want = enc(tok, "Dear ") + enc(tok, "Ann")
    assert greet.token_ids[:len(want)] == want
    g = info.modules[1]
    assert positions_of(greet.rope_runs, 0, greet.num_real) == list(range(g.start, g.end))
    question = enc(tok, "Who makes cheese?")
    assert out.token_ids[-len(question):] == question
    assert out.end_position == info.end_position + len(question)     # new text after doc-c, the last
    assert out.module_tokens == sum(m.num_real for m in out.modules)
    salted = reg.compose("docs", '<prompt schema="docs"><doc-c/>Q?</prompt>', salt="tenant")
    assert all(m.key.startswith("tenant" + KEY_SEP) for m in salted.modules)


def test_pml_json_and_prompt_objects_compose_alike(reg: SchemaRegistry) -> None:
    reg.register(DOCS)
    pml = reg.compose("docs", '<prompt schema="docs"><doc-b/><greet who="Bo"/>Where?</prompt>')
    parts = [{"module": "doc-b"}, {"module": "greet", "args": {"who": "Bo"}}, {"text": "Where?"}]
    assert reg.compose("docs", {"schema": "docs", "parts": parts}) == pml
    assert reg.compose("docs", {"parts": parts}) == pml                 # "schema" may be left out
    obj = Prompt("docs", (Import("doc-b"), Import("greet", (("who", "Bo"),)), Text("Where?")))
    assert reg.compose("docs", obj) == pml


def test_prompt_errors(reg: SchemaRegistry) -> None:
    reg.register(DOCS)
    cases = {
        "not registered": ("nope", '<prompt schema="nope"><intro/>x</prompt>'),
        "written against schema 'other'": ("docs", '<prompt schema="other"><intro/>x</prompt>'),
        "unknown module 'doc-z'": ("docs", '<prompt schema="docs"><doc-z/>x</prompt>'),
        "same union": ("docs", '<prompt schema="docs"><doc-a/><doc-b/>x</prompt>'),
        "no parameter 'whom'": ("docs", '<prompt schema="docs"><greet whom="A"/>x</prompt>'),
        "at most 4 tokens, got": ("docs", '<prompt schema="docs"><greet who="' + "very long name " * 5 + '"/>x</prompt>'),
        "new text": ("docs", '<prompt schema="docs"><doc-c/></prompt>'),
    }
    for match, (name, prompt) in cases.items():
        with pytest.raises(SchemaError, match=match):
            reg.compose(name, prompt)
    with pytest.raises(UnknownSchemaError):
        reg.compose("nope", "<prompt/>")
    with pytest.raises(SchemaError, match="unknown key"):
        reg.compose("docs", {"parts": [], "extra": 1})


def test_scaffold_replaces_its_modules(reg: SchemaRegistry) -> None:
    reg.register(DOCS)
    out = reg.compose("docs", '<prompt schema="docs"><doc-a/><doc-c/>Which town?</prompt>')
    kinds = [m.key.split(KEY_SEP)[1:4:2] for m in out.modules]
    assert ["scaffold", "ac"] in kinds and ["module", "doc-a"] not in kinds and ["module", "doc-c"] not in kinds


def test_replaced_schema_composes_with_its_new_digest(reg: SchemaRegistry) -> None:
    reg.register(DOCS)
    new = reg.register(DOCS.replace("Gamma makes cheese.", "Gamma makes wine."))
    out = reg.compose("docs", '<prompt schema="docs"><doc-c/>What?</prompt>')
    assert all(new.digest in m.key for m in out.modules)


# -- chat -----------------------------------------------------------------------------------------


def test_chat_messages_become_roles_with_the_generation_prompt(reg: SchemaRegistry, tok: Tokenizer) -> None:
    reg.register(DOCS)
    out = reg.compose_chat("docs", [{"role": "user", "content": "<doc-c/> Who makes cheese?"}])
    tail = enc(tok, " Who makes cheese?") + enc(tok, "<|im_end|>\n") + enc(tok, "<|im_start|>assistant\n")
    assert out.is_modular and out.token_ids[-len(tail):] == tail
    parts = [{"type": "text", "text": "<doc-c/>"}, {"type": "text", "text": " Who makes cheese?"}]
    assert reg.compose_chat("docs", [{"role": "user", "content": parts}]) == out
    prompt = prompt_from_messages("docs", [{"role": "system", "content": None},
                                           {"role": "user", "content": "a &lt; b <intro/>"}])
    assert prompt.parts[1].children == (Text("a < b "), Import("intro"))


def test_chat_errors(reg: SchemaRegistry, tok: Tokenizer) -> None:
    reg.register(DOCS)
    cases = {
        "role": [{"role": "tool", "content": "x"}],
        "messages\\[0\\].content": [{"role": "user", "content": "a < b"}],       # not escaped
        "unknown module": [{"role": "user", "content": "<doc-z/>x"}],
        "nest": [{"role": "user", "content": "<user>x</user>"}],
        "at least one": [],
        "parts are supported": [{"role": "user", "content": [{"type": "image_url"}]}],
    }
    for match, messages in cases.items():
        with pytest.raises(SchemaError, match=match):
            reg.compose_chat("docs", messages)
    with pytest.raises(UnknownSchemaError):
        reg.compose_chat("nope", [{"role": "user", "content": "x"}])


def test_without_chat_markers_roles_are_refused(tok: Tokenizer) -> None:
    no_chat = SchemaRegistry(lambda s: enc(tok, s), model_id="m", page_size=PAGE, placeholder_id=0)
    with pytest.raises(SchemaError, match="uses chat roles"):
        no_chat.register(DOCS)
    nested = '<schema name="n"><module name="m"><union><module name="u"><user>x</user></module></union></module></schema>'
    with pytest.raises(SchemaError, match="uses chat roles"):
        no_chat.register(nested)
    no_chat.register('<schema name="plain"><module name="m">Text.</module></schema>')
    assert not no_chat.compose("plain", '<prompt schema="plain"><m/> More.</prompt>').is_modular
    with pytest.raises(SchemaError, match="the prompt uses chat roles"):
        no_chat.compose("plain", '<prompt schema="plain"><m/><user>More.</user></prompt>')
    with pytest.raises(SchemaError, match="no chat template"):
        no_chat.compose_chat("plain", [{"role": "user", "content": "x"}])
    # A template whose roles cannot be cut into markers: no chat either.
    reverse = "{% for m in messages|reverse %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<a>"
    odd = SchemaRegistry.for_tokenizer(tok, model_id="m", page_size=PAGE, chat_template=reverse)
    assert odd.role_text is None and odd.generation_prompt is None


def test_limits_apply_to_prompts(tok: Tokenizer) -> None:
    reg = SchemaRegistry.for_tokenizer(tok, model_id="m", page_size=PAGE, limits=Limits(max_bytes=200))
    reg.register('<schema name="s"><module name="m">x</module></schema>')
    with pytest.raises(SchemaError, match="200"):
        reg.compose("s", '<prompt schema="s"><m/>' + "y" * 300 + "</prompt>")


def test_builder_schema_with_union_and_scaffold(reg: SchemaRegistry) -> None:
    s = schema("b", module("x", "X text"), union(module("u1", "one"), module("u2", "two two")),
               scaffolds=[scaffold("xu", "x", "u1")])
    info = reg.register(s)
    assert [m.name for m in info.modules] == ["x", "u1", "u2"] and info.scaffolds[0].modules == ["x", "u1"]
