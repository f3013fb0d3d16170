"""Prompt schemas over HTTP on a real server: /v1/schemas (register, list, show, delete, errors) and
completions / chat completions with ``prompt_schema``, driven by the official openai client. The server
runs the tiny dummy model of ``tests/runtime/server_process.py`` (the default model's tokenizer: what is
checked is token counts and greedy outputs alike, not their words)."""

from __future__ import annotations

import httpx
import openai
import pytest

from radixrelay.config import EngineConfig
from radixrelay.modules.registry import SchemaRegistry
from radixrelay.text.tokenizer import load_tokenizer
from tests.runtime.server_process import ServerProcess
from tests.text.test_tokenizer import default_gguf

pytestmark = pytest.mark.timeout(300)
MODEL = "relay"
CONTEXT = 512
DOCS = """<schema name="docs">
  <system>You answer questions about the documents below.</system>
  <module name="intro">The documents:</module>
  <module name="greet">The reader is called <param name="who" len="4"/>.</module>
  <union>
    <module name="doc-a">Alpha is a small town by the sea. Its harbour is full of boats.</module>
    <module name="doc-b">Beta is a city in the mountains, famous for its old stone bridges.</module>
  </union>
  <module name="doc-c">Gamma is a village that makes cheese from goat milk.</module>
  <scaffold name="ac" modules="doc-a doc-c"/>
</schema>"""
PLAIN = """<schema name="plain">
  <module name="preamble">You are a helpful assistant. Answer every question in one short, clear sentence.</module>
  <module name="other">This module is never first.</module>
</schema>"""
# Positions past the context: refused at registration (its modules could never be used).
FAR = ('<schema name="far"><module name="filler">' + "lorem ipsum " * 300 + '</module>'
       '<module name="late">The end.</module></schema>')


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model):
    # the last --served-model-name given wins: this one, not tiny_model's
    srv = ServerProcess(tmp_path_factory.mktemp("schemas"), *tiny_model, "--kv-cache-tokens", "4096", "--max-n", "4",
                        "--context-length", str(CONTEXT), "--served-model-name", MODEL)
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=f"{server.base_url}/v1", timeout=120) as h:
        for pml in (DOCS, PLAIN):
            assert h.post("/schemas", json={"schema": pml}).status_code == 200
        far = h.post("/schemas", json={"schema": FAR})
        assert far.status_code == 400 and f"context of {CONTEXT}" in far.json()["error"]["message"], far.text
        yield h


@pytest.fixture(scope="module")
def client(server, http):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(default_gguf())


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


# -- /v1/schemas ----------------------------------------------------------------------------------


def test_register_show_list(http) -> None:
    info = http.post("/schemas", json={"schema": DOCS, "model": MODEL}).json()
    assert info["object"] == "schema" and info["name"] == "docs" and info["model"]
    assert len(info["digest"]) == 64
    assert [m["name"] for m in info["modules"]] == ["intro", "greet", "doc-a", "doc-b", "doc-c"]
    assert info["modules"][1]["params"] == [{"name": "who", "len": 4}]
    assert info["scaffolds"] == [{"name": "ac", "modules": ["doc-a", "doc-c"]}]
    assert info["end_position"] > 0 and info["num_tokens"] >= info["modules"][-1]["end"] - info["modules"][0]["start"]
    again = http.post("/schemas", json={"schema": DOCS}).json()
    assert again == info                                   # idempotent: same digest, same created
    assert http.get("/schemas/docs").json() == info
    listing = http.get("/schemas").json()
    assert listing["object"] == "list" and {"docs", "plain"} <= {s["name"] for s in listing["data"]}


def test_replace_and_delete(http) -> None:
    first = http.post("/schemas", json={"schema": '<schema name="tmp"><module name="m">one</module></schema>'}).json()
    second = http.post("/schemas", json={"schema": '<schema name="tmp"><module name="m">two</module></schema>'}).json()
    assert second["digest"] != first["digest"] and http.get("/schemas/tmp").json()["digest"] == second["digest"]
    assert http.delete("/schemas/tmp").json() == {"name": "tmp", "deleted": True, "object": "schema.deleted"}
    err = error_of(http.delete("/schemas/tmp"), 404)
    assert err["code"] == "schema_not_found" and "'tmp'" in err["message"]
    assert error_of(http.get("/schemas/tmp"), 404)["type"] == "invalid_request_error"
    assert "tmp" not in {s["name"] for s in http.get("/schemas").json()["data"]}


@pytest.mark.parametrize("body, param, match", [
    ({"schema": "<schema name='x'><module>no name</module></schema>"}, "schema", "name"),
    ({"schema": "not xml at all"}, "schema", ""),
    ({"schema": '<?xml version="1.0"?><!DOCTYPE x [<!ENTITY a "aaaa"><!ENTITY b "&a;&a;&a;">]>'
                '<schema name="x"><module name="m">&b;</module></schema>'}, "schema", ""),
    ({"schema": '<schema name="x"><module name="m"><param name="p" len="100000000"/></module></schema>'},
     "schema", "len"),
    ({"schema": DOCS, "model": "another-model"}, "model", "another-model"),
    ({"pml": DOCS}, "schema", ""),
    ({"schema": 42}, "schema", ""),
])
def test_bad_schemas_are_400(http, body, param, match) -> None:
    err = error_of(http.post("/schemas", json=body), 400)
    assert err["type"] == "invalid_request_error" and err["param"] == param and match in err["message"]


def test_schema_body_must_be_json(http) -> None:
    assert http.post("/schemas", content=DOCS, headers={"content-type": "application/xml"}).status_code == 415
    assert error_of(http.post("/schemas", content=b"{not json"), 400)["message"].startswith("request body")


def test_schema_routes_stay_out_of_openapi(server) -> None:
    doc = httpx.get(f"{server.base_url}/openapi.json").json()
    assert not any(path.startswith("/v1/schemas") for path in doc["paths"])
    props = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert props["prompt_schema"]["type"] == "null"


# -- requests with prompt_schema: 400s ------------------------------------------------------------


def completion(client, prompt, schema="docs", **kw):
    kw.setdefault("max_tokens", 8)
    kw.setdefault("temperature", 0)
    return client.completions.create(model=MODEL, prompt=prompt,
                                     extra_body={"prompt_schema": schema, **kw.pop("extra", {})}, **kw)


@pytest.mark.parametrize("schema, prompt, param, match", [
    ("nope", '<prompt schema="nope"><intro/>x</prompt>', "prompt_schema", "not registered"),
    ("docs", '<prompt schema="docs"><doc-z/>x</prompt>', "prompt", "unknown module 'doc-z'"),
    ("docs", '<prompt schema="docs"><greet who="' + "a very long name indeed " * 3 + '"/>x</prompt>',
     "prompt", "at most 4 tokens"),
    ("docs", '<prompt schema="plain"><preamble/>x</prompt>', "prompt", "schema 'plain'"),
    ("docs", '<prompt schema="docs"><doc-a/><doc-b/>x</prompt>', "prompt", "same union"),
    ("docs", "<prompt schema='docs'><intro/>unclosed", "prompt", ""),
    ("docs", [1, 2, 3], "prompt", "not token ids"),
])
def test_bad_prompts_are_400(client, http, schema, prompt, param, match) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        completion(client, prompt, schema)
    body = err.value.body
    assert body["param"] == param and match in body["message"], body
    if param == "prompt_schema":
        assert body["code"] == "schema_not_found"


def test_other_400s(client, http) -> None:
    with pytest.raises(openai.BadRequestError, match="needs `prompt_schema`"):
        client.completions.create(model=MODEL, prompt={"parts": [{"text": "hi"}]}, max_tokens=4)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="echo"):
        completion(client, '<prompt schema="plain"><preamble/>Hi</prompt>', "plain", echo=True)
    with pytest.raises(openai.BadRequestError, match="context"):     # plain-prompt length + max_tokens
        completion(client, '<prompt schema="plain"><preamble/>Hi</prompt>', "plain", max_tokens=CONTEXT)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, max_tokens=4, extra_body={"prompt_schema": "docs"},
                                       messages=[{"role": "user", "content": "<doc-z/>Why?"}])
    assert err.value.body["param"] == "messages" and "doc-z" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, max_tokens=4, extra_body={"prompt_schema": "docs"},
                                       messages=[{"role": "tool", "content": "x"}])
    assert err.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, max_tokens=4, extra_body={"prompt_schema": "gone"},
                                       messages=[{"role": "user", "content": "x"}])
    assert err.value.body["param"] == "prompt_schema"


# -- requests with prompt_schema: served ----------------------------------------------------------


def test_prefix_only_prompt_equals_the_plain_prompt(client, tok) -> None:
    """Exact reuse: the first module then new text is the same token sequence, served the same."""
    out = completion(client, '<prompt schema="plain"><preamble/> The capital of France is</prompt>', "plain")
    ids = (tok.encode("You are a helpful assistant. Answer every question in one short, clear sentence.", add_special_tokens=False)
           + tok.encode(" The capital of France is", add_special_tokens=False))
    plain = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert out.choices[0].text == plain.choices[0].text
    assert out.usage.prompt_tokens == plain.usage.prompt_tokens == len(ids)
    assert out.usage.prompt_tokens_details.module_tokens == 0
    again = completion(client, {"parts": [{"module": "preamble"}, {"text": " The capital of France is"}]}, "plain")
    assert again.choices[0].text == out.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens >= 16       # a plain prefix hit


def test_modular_completion_reports_module_tokens(client) -> None:
    prompt = '<prompt schema="docs"><greet who="Ann"/><doc-c/>Question: what does Gamma make? Answer:</prompt>'
    first = completion(client, prompt)
    assert first.choices[0].finish_reason in ("stop", "length")
    second = completion(client, prompt)
    assert second.choices[0].text == first.choices[0].text            # greedy, same module KV
    details = second.usage.prompt_tokens_details
    assert 0 < details.module_tokens <= details.cached_tokens <= second.usage.prompt_tokens


def test_usage_shows_module_padding_apart(client, tok) -> None:
    """``prompt_tokens`` counts what the model processes, module padding included;
    ``module_padding_tokens`` says how much of it is padding (zero for a prefix-only prompt)."""
    local = SchemaRegistry.for_tokenizer(tok, model_id="default", page_size=EngineConfig().page_size)
    local.register(DOCS)
    prompt = '<prompt schema="docs"><greet who="Ann"/><doc-c/>Question: what does Gamma make? Answer:</prompt>'
    composed = local.compose("docs", prompt)
    padding = sum(len(m.token_ids) - m.num_real for m in composed.modules)
    assert composed.is_modular and padding > 0
    for out in (completion(client, prompt), completion(client, prompt)):
        assert out.usage.prompt_tokens == len(composed.token_ids)
        details = out.usage.prompt_tokens_details
        assert details.module_padding_tokens == padding
        assert details.module_tokens <= out.usage.prompt_tokens   # module KV: padding pages included
    chunks = list(completion(client, [prompt, prompt], stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.module_padding_tokens == 2 * padding
    plain = completion(client, '<prompt schema="plain"><preamble/> Hello</prompt>', "plain")
    assert plain.usage.prompt_tokens_details.module_padding_tokens == 0
    messages = [{"role": "user", "content": "<doc-a/><doc-c/>Which town has a harbour?"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                          extra_body={"prompt_schema": "docs"})
    chat_composed = local.compose_chat("docs", messages)
    assert chat.usage.prompt_tokens == len(chat_composed.token_ids)
    assert chat.usage.prompt_tokens_details.module_padding_tokens == \
        sum(len(m.token_ids) - m.num_real for m in chat_composed.modules)


def test_modular_completion_n_stream_stop_and_batch(client, http) -> None:
    prompt = '<prompt schema="docs"><doc-b/>Tell me about Beta.</prompt>'
    out = completion(client, prompt, n=2, max_tokens=6, temperature=0.8, seed=3)
    assert [c.index for c in out.choices] == [0, 1] and out.usage.completion_tokens <= 12
    batch = completion(client, [prompt, '<prompt schema="docs"><doc-a/>Tell me about Alpha.</prompt>'])
    assert len(batch.choices) == 2
    chunks = list(completion(client, prompt, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    plain = completion(client, prompt)
    assert text == plain.choices[0].text
    module_tokens = plain.usage.prompt_tokens_details.module_tokens
    assert chunks[-1].usage.prompt_tokens_details.module_tokens == module_tokens > 0
    stopped = completion(client, prompt, stop=[" "], max_tokens=16)
    assert " " not in stopped.choices[0].text.strip()


def test_modular_chat(client) -> None:
    messages = [{"role": "user", "content": "<doc-a/><doc-c/>Which town has a harbour?"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                         extra_body={"prompt_schema": "docs"})
    assert out.choices[0].message.role == "assistant" and out.choices[0].finish_reason in ("stop", "length")
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                           extra_body={"prompt_schema": "docs"})
    assert again.choices[0].message.content == out.choices[0].message.content
    assert again.usage.prompt_tokens_details.module_tokens > 0
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                            stream=True, extra_body={"prompt_schema": "docs"})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == out.choices[0].message.content


def test_cache_salt_keeps_working(client) -> None:
    prompt = '<prompt schema="docs"><doc-c/>What does Gamma make?</prompt>'
    salted = completion(client, prompt, extra={"cache_salt": "tenant-1"})
    assert salted.choices[0].text == completion(client, prompt).choices[0].text
