"""Tool calls, reasoning and template variables over HTTP with the official openai client, on the
shared hostile-input server (its template knows no tools: the generic fallback renders them and calls
are read in the ``<tool_call>`` format; it thinks like Qwen3's, see ``conftest.py``).

The tiny model never calls a tool by itself, so the end-to-end checks force calls (``required``, a named
function): the structural tag makes them parse and match their schemas, streamed and not. Output
reading on fixed strings and chunkings: ``tests/text/test_tool_calls.py``."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.server.conftest import MODEL

pytestmark = pytest.mark.timeout(300)
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"]}
TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(hostile_server):
    return openai.OpenAI(base_url=f"{hostile_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(hostile_server):
    with httpx.Client(base_url=hostile_server.base_url, timeout=120) as h:
        yield h


def _check_calls(calls, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _streamed(stream) -> tuple[str, list[dict], str | None, str]:
    """(content, calls as {id, name, arguments}, finish_reason, reasoning) of a streamed choice 0."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        content += delta.content or ""
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        for piece in delta.tool_calls or []:
            if piece.id is not None:
                assert piece.index not in calls and piece.function.name
                calls[piece.index] = {"id": piece.id, "name": piece.function.name, "arguments": ""}
            calls[piece.index]["arguments"] += piece.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish, reasoning


@pytest.mark.parametrize("tool_choice,names", [
    ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"}),
    ("required", {"get_weather", "get_time"}),
])
def test_forced_calls_parse_and_match_their_schema(client, tool_choice, names):
    kw = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": tool_choice, "max_tokens": 60,
          "temperature": 0, "parallel_tool_calls": False}
    full = client.chat.completions.create(**kw)
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    _check_calls(choice.message.tool_calls, names)
    assert len(choice.message.tool_calls) == 1
    content, calls, finish, _ = _streamed(client.chat.completions.create(**kw, stream=True))
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == \
        [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def test_auto_and_none(client, http):
    auto = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=6, temperature=0)
    choice = auto.choices[0]
    if choice.message.tool_calls:                   # the model chose to call: constrained from the trigger
        _check_calls(choice.message.tool_calls, set(SCHEMAS))
    else:
        assert choice.message.content and choice.finish_reason in ("stop", "length")
    content, calls, finish, _ = _streamed(client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=6, temperature=0, stream=True))
    assert (content, finish) == (choice.message.content or "", choice.finish_reason)
    assert [c["name"] for c in calls] == [c.function.name for c in choice.message.tool_calls or []]
    none = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none",
                                          max_tokens=6, temperature=0)
    content, calls, finish, _ = _streamed(client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=6, temperature=0, stream=True))
    assert (content, calls, finish) == (none.choices[0].message.content, [], none.choices[0].finish_reason)
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=0)
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content
    assert none.usage.prompt_tokens > plain.usage.prompt_tokens + 50     # the tools are in the prompt
    counted = http.post("/tokenize", json={"messages": ASK, "tools": TOOLS}).json()["count"]
    assert counted == none.usage.prompt_tokens                           # /tokenize renders them alike


def test_tool_result_round_trip(client, http):
    """A call sent back (as the client got it: ``arguments`` a JSON string, ``content`` null) with its
    result: rendered (the generic fallback: a <tool_call> block, a <tool_response> block) and answered."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    out = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    ids = http.post("/tokenize", json={"messages": history, "tools": TOOLS}).json()["tokens"]
    assert len(ids) == out.usage.prompt_tokens
    text = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>' in text
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in text


def test_reasoning_is_separated(client):
    opened = {"chat_template_kwargs": {"enable_thinking": True}, "guided_regex": r"Sky is blue\.</think>Blue\."}
    full = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=30, temperature=0,
                                          reasoning_effort="low", extra_body=opened)
    message = full.choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == ("Sky is blue.", "Blue.")
    content, _, finish, reasoning = _streamed(client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=30, temperature=0, stream=True, extra_body=opened))
    assert (reasoning, content, finish) == ("Sky is blue.", "Blue.", "stop")
    # The model opens the block itself; and with separate_reasoning false it stays in the content.
    own = {"guided_regex": r"<think>Hm\.</think> Yes\."}
    full = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=30, temperature=0, extra_body=own)
    assert (full.choices[0].message.model_extra["reasoning_content"], full.choices[0].message.content) == \
        ("Hm.", "Yes.")
    kept = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=30, temperature=0,
                                          extra_body={**own, "separate_reasoning": False})
    assert kept.choices[0].message.content == "<think>Hm.</think> Yes."
    assert kept.choices[0].message.model_extra.get("reasoning_content") is None


def _error(http: httpx.Client, **fields) -> dict:
    body = {"model": MODEL, "messages": ASK, "max_tokens": 2, **fields}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    return response.json()["error"]


@pytest.mark.parametrize("fields,param,words", [
    ({"tools": {"type": "function"}}, "tools", "array"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "function.name"),
    ({"tools": TOOLS + [TOOLS[0]]}, "tools", "twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string", "maxLength": 10**6}}}]},
     "tools", "maxLength"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "at least one tool"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", None),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "forced"),
    ({"messages": [*ASK, {"role": "tool", "content": "42"}]}, "messages", "tool_call_id"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]}]}, "messages", "tool_calls"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "messages"),
    ({"chat_template_kwargs": {"self": 1}}, "chat_template_kwargs", "self"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort", None),
    ({"functions": [{"name": "f"}]}, "functions", "tools"),
])
def test_bad_tool_requests_get_400(http, fields, param, words):
    error = _error(http, **fields)
    assert error["param"] == param, error
    if words is not None:
        assert words in error["message"], error
