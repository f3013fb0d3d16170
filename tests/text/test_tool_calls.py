"""Tool-call formats on fixed strings: whole outputs, every chunking of them (streams join to the
whole response and never take text back), structural tags that xgrammar compiles, and the fallback
rendering for templates without tool support."""

from __future__ import annotations

import json

import pytest

from radixrelay.text.chat_output import ChatOutput
from radixrelay.text.reasoning import split
from radixrelay.text.tool_calls import (
    Function,
    constraint,
    detect_format,
    fallback_messages,
    get_format,
    template_messages,
)

ARGS = '{"city": "Paris", "days": [1, 2], "note": "a } in \\" a string"}'
CASES = [
    ("hermes", f'Let me look.\n<tool_call>\n{{"name": "weather", "arguments": {ARGS}}}\n</tool_call>',
     "Let me look.\n", [("weather", ARGS)]),
    ("hermes", (f'<tool_call>\n{{"name": "a", "arguments": {{}}}}\n</tool_call>\n<tool_call>\n'
                f'{{"arguments": {ARGS}, "name": "b"}}\n</tool_call>'), "", [("a", "{}"), ("b", ARGS)]),
    ("hermes", "no call here < tool_call >", "no call here < tool_call >", []),
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {"x": 1}}', "", [("a", '{"x": 1}')]),   # close left out
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {"x": ', '<tool_call>\n{"name": "a", "arguments": {"x": ',
     []),                                                                                     # cut: content
    ("hermes", '<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>', "", [("a", '{"x": 1}')]),
    ("llama3_json", f'{{"name": "weather", "parameters": {ARGS}}}', "", [("weather", ARGS)]),
    ("llama3_json", f'<|python_tag|>{{"name": "a", "parameters": {{}}}}; {{"name": "b", "parameters": {ARGS}}}',
     "", [("a", "{}"), ("b", ARGS)]),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", "The answer is {x}.", "The answer is {x}.", []),
    ("mistral", f'Sure. [TOOL_CALLS][{{"name": "weather", "arguments": {ARGS}}}, {{"name": "b", "arguments": {{}}}}]',
     "Sure. ", [("weather", ARGS), ("b", "{}")]),
    ("mistral", "[TOOL_CALL] is not it", "[TOOL_CALL] is not it", []),
    ("mistral_args", f"Sure. [TOOL_CALLS]weather[ARGS]{ARGS}[TOOL_CALLS]b[ARGS]{{}}", "Sure. ",
     [("weather", ARGS), ("b", "{}")]),
    ("mistral_args", "[TOOL_CALLS]bad name[ARGS]{}", "[TOOL_CALLS]bad name[ARGS]{}", []),
]


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_whole_outputs(name, text, content, calls):
    got_content, got_calls = get_format(name).parse(text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    for c in got_calls:
        json.loads(c.arguments)


def _stream(name: str, chunks: list[str]):
    out = ChatOutput(calls=get_format(name))
    content, names, args, ids = "", {}, {}, {}
    for i, chunk in enumerate(chunks):
        pieces = out.feed(chunk, final=i == len(chunks) - 1)
        content += pieces.content
        for d in pieces.calls:
            if d.id is not None:
                assert d.index not in ids and d.index == len(ids)     # a call starts once, in order
                ids[d.index], names[d.index], args[d.index] = d.id, d.name, ""
            args[d.index] += d.arguments
    return out, content, [(names[i], args[i]) for i in sorted(names)], ids


@pytest.mark.parametrize("name,text,content,calls", CASES)
@pytest.mark.parametrize("size", [1, 3, 7])
def test_streams_join_to_the_whole_output(name, text, content, calls, size):
    chunks = [text[i:i + size] for i in range(0, len(text), size)] + [""]
    out, streamed, streamed_calls, ids = _stream(name, chunks)
    whole_content, whole_calls = get_format(name).parse(text)
    if whole_calls or not streamed_calls:
        assert streamed == whole_content
        assert streamed_calls == [(c.name, c.arguments) for c in whole_calls]
        assert [c.id for c in out.tool_calls] == [ids[i] for i in sorted(ids)]


def test_text_that_may_open_a_call_is_held_back():
    out = ChatOutput(calls=get_format("hermes"))
    assert out.feed("Hi <tool").content == "Hi "
    assert out.feed("box>").content == "<toolbox>"
    pieces = out.feed('<tool_call>\n{"name": "f", "arguments": {"a": ')
    assert pieces.content == "" and [(d.name, d.arguments) for d in pieces.calls] == [("f", ""), (None, '{"a": ')]
    assert [d.arguments for d in out.feed("1}}\n</tool_call>", final=True).calls] == ["1}"]


def test_a_call_cut_short_is_content_unless_it_was_streamed():
    text = '<tool_call>\n{"name": "f", "arguments": {"a": '
    whole = ChatOutput(calls=get_format("hermes"))
    assert whole.feed(text, final=True).content == text and whole.tool_calls == []
    streamed = ChatOutput(calls=get_format("hermes"))
    assert [d.name for d in streamed.feed(text).calls] == ["f", None]
    assert streamed.feed("", final=True).content == "" and streamed.tool_calls[0].name == "f"


def test_forced_calls_without_a_marker():
    assert get_format("mistral").parse('[{"name": "f", "arguments": {}}]', forced=True)[1][0].name == "f"
    assert get_format("llama3_json").parse('{"name": "f", "parameters": {}}', forced=True)[1][0].name == "f"
    calls = get_format("mistral_args").parse('f[ARGS]{"a": 1}g[ARGS]{}', forced=True)[1]
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"a": 1}'), ("g", "{}")]


@pytest.mark.parametrize("text,opened,reasoning,content", [
    ("<think>\nHmm, 2.\n</think>\n\nIt is 2.", False, "Hmm, 2.\n", "It is 2."),
    ("Hmm.</think>Yes.", True, "Hmm.", "Yes."),
    ("<think>never closed", False, "never closed", ""),
    ("No thinking <think>here</think>", False, "", "No thinking <think>here</think>"),
])
def test_reasoning_split_whole_and_streamed(text, opened, reasoning, content):
    whole = split(text, opened=opened, final=True)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    for size in (1, 2, 5):
        out = ChatOutput(reasoning=True, opened=opened)
        chunks = [text[i:i + size] for i in range(0, len(text), size)]
        r = c = ""
        for i, chunk in enumerate(chunks):
            p = out.feed(chunk, final=i == len(chunks) - 1)
            r, c = r + p.reasoning, c + p.content
        assert (r, c) == (reasoning, content)


def test_reasoning_then_calls():
    out = ChatOutput(reasoning=True, calls=get_format("hermes"))
    out.feed('<think>call f</think>\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', final=True)
    assert out.reasoning_text == "call f" and out.content_text == ""
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("f", "{}")]


def test_detection_from_the_template():
    assert detect_format("{{ '<tool_call>' }}").name == "hermes"
    assert detect_format("[TOOL_CALLS] {{ x }}").name == "mistral"
    assert detect_format("[TOOL_CALLS]{{ name }}[ARGS]{{ args }}").name == "mistral_args"
    assert detect_format("<|python_tag|>").name == "llama3_json"
    assert detect_format("{{ messages }}").name == "hermes"


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral", "mistral_args"])
@pytest.mark.parametrize("mode,parallel", [("auto", True), ("required", True), ("required", False)])
def test_structural_tags_compile_and_force_the_format(name, mode, parallel):
    xgr = pytest.importorskip("xgrammar")
    fmt = get_format(name)
    fns = [Function("weather", {"type": "object", "properties": {"city": {"type": "string"}},
                                "required": ["city"]}), Function("noop", None)]
    tag = constraint(fmt, fns, mode, parallel=parallel, marker_is_text=True)
    grammar = xgr.Grammar.from_structural_tag(json.dumps(tag))
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo(["a"])).compile_grammar(grammar)
    one = fmt.call_begin("weather", True) + '{"city": "Paris"}' + fmt.call_end(True)
    prefix = "[TOOL_CALLS][" if name == "mistral" else ""
    text = prefix + one + ("]" if name == "mistral" else "")
    matcher = xgr.GrammarMatcher(compiled)
    assert matcher.accept_string(text), text
    assert [(c.name, json.loads(c.arguments)) for c in fmt.parse(text)[1]] == [("weather", {"city": "Paris"})]
    bad = xgr.GrammarMatcher(compiled)
    assert not bad.accept_string(prefix + fmt.call_begin("weather", True) + '{"town": 1}')


def test_llama3_auto_calls_are_constrained_from_their_opening_text():
    """Llama 3 JSON's marker is a special token: under auto its calls are triggered by their opening text,
    so text stays free, and a call that opens is one of the functions with arguments under its schema."""
    xgr = pytest.importorskip("xgrammar")
    fmt = get_format("llama3_json")
    fns = [Function("weather", {"type": "object", "properties": {"city": {"type": "string"}},
                                "required": ["city"]}), Function("noop", None)]
    for marker_is_text in (False, True):
        tag = constraint(fmt, fns, "auto", parallel=True, marker_is_text=marker_is_text)
        compiled = xgr.GrammarCompiler(xgr.TokenizerInfo(["a"])).compile_grammar(
            xgr.Grammar.from_structural_tag(json.dumps(tag)))

        def accepts(text: str) -> bool:
            return xgr.GrammarMatcher(compiled).accept_string(text)

        assert accepts("It is sunny today; no tool needed.")
        assert accepts('{"name": "weather", "parameters": {"city": "Paris"}}')
        assert accepts('{"name": "noop", "parameters": {"x": [1]}}; {"name": "weather", "parameters": {"city": "Oslo"}}')
        assert not accepts('{"name": "wether", "parameters": {}}')                 # no such function
        assert not accepts('{"name": "weather", "parameters": {"town": "Paris"}}')  # not its schema


def test_fallback_rendering_and_template_arguments():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    out = fallback_messages(msgs, tools)
    assert out[0]["role"] == "system" and '"name": "f"' in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'}
    assert out[3] == {"role": "user", "content": "<tool_response>\n42\n</tool_response>"}
    assert template_messages(msgs)[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}


def test_the_router_renders_tools_as_the_server_does():
    from radixrelay.router.prompt import PromptKeys
    from radixrelay.server import openai_protocol as oa
    from radixrelay.text.chat_template import ChatTemplate

    template = ChatTemplate("{{ tools | tojson }}|{{ x }}|{{ reasoning_effort }}|"
                            "{% for m in messages %}{{ m.content }}{% endfor %}", model_name="m")
    raw = [{"function": {"parameters": {"type": "object"}, "description": None, "name": "f"}, "type": "function"}]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": raw,
            "chat_template_kwargs": {"x": 1}, "reasoning_effort": "low"}
    req = oa.decode_request(json.dumps(body).encode(), oa.ChatCompletionRequest)
    served = template.render(req.messages, tools=req.tool_request().tools, **req.template_kwargs())
    assert served == '[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]|1|low|hi'
    assert PromptKeys(None, template)._render_chat(body) == served


def test_a_template_with_tool_support_gets_tools_and_argument_objects():
    from radixrelay.text.chat_template import ChatTemplate

    template = ChatTemplate(
        "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }};{% endfor %}</tools>\n{% endif %}"
        "{% for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}{% for c in m.tool_calls %}"
        "<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>"
        "{% endfor %}{% elif m.role == 'tool' %}<tool_response>{{ m.content }}</tool_response>"
        "{% else %}{{ m.role }}: {{ m.content }}{% endif %}\n{% endfor %}", model_name="m")
    assert template.supports_tools and detect_format(template.text).name == "hermes"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    assert template.render(msgs, add_generation_prompt=False, tools=tools) == (
        '<tools>{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}};</tools>\n'
        'user: hi<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call><tool_response>42</tool_response>')


def test_a_forced_call_after_an_open_reasoning_block():
    xgr = pytest.importorskip("xgrammar")
    fmt = get_format("hermes")
    tag = constraint(fmt, [Function("f", {"type": "object", "properties": {"a": {"type": "integer"}},
                                          "required": ["a"]})], "required", parallel=False, marker_is_text=True,
                     open_reasoning="</think>")
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo(["a"])).compile_structural_tag(json.dumps(tag))
    text = 'Let me see.</think><tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    assert xgr.GrammarMatcher(compiled).accept_string(text)
    out = ChatOutput(reasoning=True, opened=True, calls=fmt, forced=True)
    out.feed(text, final=True)
    assert out.reasoning_text == "Let me see." and [(c.name, c.arguments) for c in out.tool_calls] == [("f", '{"a": 1}')]


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral", "mistral_args"])
def test_long_streams_cost_linear_time(name):
    """100K characters of reasoning, then of answer, in 4-character pieces: each piece is decided
    without rescanning what was sent (quadratic work would take a minute here)."""
    import time

    out = ChatOutput(reasoning=True, opened=True, calls=get_format(name))
    text = "a thought < " * 8_000 + "</think>" + "an answer <tool_cal " * 5_000
    started = time.monotonic()
    pieces = [out.feed(text[i:i + 4]) for i in range(0, len(text), 4)] + [out.feed("", final=True)]
    assert time.monotonic() - started < 5
    assert "".join(p.reasoning for p in pieces) == "a thought < " * 8_000
    assert "".join(p.content for p in pieces) == "an answer <tool_cal " * 5_000
