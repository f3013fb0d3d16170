"""Bounds on what one request may ask of the host, over real HTTP: stop strings (count and length),
stop token ids (count), JSON-schema repetition keywords and regex counts, ``$ref``s the grammar
cannot follow faithfully (to itself with nothing optional in between, to a URL, to nothing),
schemas and patterns that nothing matches, and prompt schemas whose positions run past the model's
context. At each limit: accepted; past it: a 400 naming the field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from radixrelay.model.model_registry import resolve_model_path
from radixrelay.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from radixrelay.structured.spec import MAX_REPETITION
from radixrelay.text.tokenizer import load_tokenizer
from tests.server.conftest import MODEL

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def http(hostile_server):
    with httpx.Client(base_url=hostile_server.base_url, timeout=120) as h:
        yield h


def _complete(http: httpx.Client, **fields) -> httpx.Response:
    return http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 4,
                                              "temperature": 0, **fields})


def _refused(response: httpx.Response, param: str, *words: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert all(w in error["message"] for w in words), error["message"]


def test_stop_strings_at_and_past_the_limits(http):
    at_limit = [f"{i:03d}" + "z" * (MAX_STOP_STRING_CHARS - 3) for i in range(MAX_STOP_STRINGS)]
    assert _complete(http, stop=at_limit).status_code == 200
    _refused(_complete(http, stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]), "stop",
             str(MAX_STOP_STRINGS))
    _refused(_complete(http, stop=["y" * (MAX_STOP_STRING_CHARS + 1)]), "stop", str(MAX_STOP_STRING_CHARS))


def test_stop_token_ids_at_and_past_the_limit(http):
    """Past the count a 400 naming the field and the limit (192K ids once slowed the whole batch);
    duplicates count. At the limit, duplicates included, a request is served and stops on its ids."""
    _refused(_complete(http, stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1))), "stop_token_ids",
             str(MAX_STOP_TOKEN_IDS))
    _refused(_complete(http, stop_token_ids=list(range(192_000))), "stop_token_ids", str(MAX_STOP_TOKEN_IDS))
    _refused(_complete(http, stop_token_ids=[5] * (MAX_STOP_TOKEN_IDS + 1)), "stop_token_ids",
             str(MAX_STOP_TOKEN_IDS))
    first = _complete(http, max_tokens=1).json()["choices"][0]["text"]
    ids = load_tokenizer(resolve_model_path("default")).encode(first, add_special_tokens=False)
    assert len(ids) == 1, (first, ids)
    stops = [ids[0]] * 3 + [t for t in range(1000, 2000) if t != ids[0]][:MAX_STOP_TOKEN_IDS - 3]
    stopped = _complete(http, stop_token_ids=stops).json()["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["text"] == "", stopped


@pytest.mark.parametrize("keyword, schema", [
    ("maxLength", {"type": "string", "maxLength": MAX_REPETITION + 1}),
    ("minLength", {"type": "object", "properties": {"a": {"type": "string", "minLength": 4096}}}),
    ("maxItems", {"type": "array", "items": {"type": "integer"}, "maxItems": 10_000}),
    ("minProperties", {"type": "object", "minProperties": 1000}),
    ("{0,300}", {"type": "string", "pattern": "^[a-z]{0,300}$"}),
])
def test_schema_repetitions_past_the_limit_are_400(http, keyword, schema):
    _refused(_complete(http, guided_json=schema), "guided_json", keyword, str(MAX_REPETITION))


def test_regex_counts_past_the_limit_are_400_at_the_limit_200(http):
    _refused(_complete(http, guided_regex=f"[a-z]{{0,{MAX_REPETITION + 1}}}"), "guided_regex", str(MAX_REPETITION))
    assert _complete(http, guided_regex=f"[a-z]{{1,{MAX_REPETITION}}}").status_code == 200


@pytest.mark.parametrize("schema, words", [
    ({"$ref": "#"}, ("cycle",)),
    ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, ("cycle",)),
    ({"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}, ("cycle",)),
    ({"$ref": "https://example.com/person.json"}, ("local",)),
    ({"type": "object", "properties": {"p": {"$ref": "https://example.com/p.json#/a"}}}, ("local",)),
    ({"$ref": "#/$defs/missing"}, ("points to nothing",)),
])
def test_refs_the_grammar_cannot_follow_are_400(http, schema, words):
    _refused(_complete(http, guided_json=schema), "guided_json", *words)
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    response = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 4, "response_format": fmt,
                                                        "messages": [{"role": "user", "content": "Hi"}]})
    _refused(response, "response_format", *words)


@pytest.mark.parametrize("schema", [
    {"anyOf": [{"$ref": "#"}, {"$ref": "#"}]},
    {"type": "array", "minItems": 1, "items": {"anyOf": [{"$ref": "#/items"}, {"$ref": "#/items"}]}},
    {"type": "string", "pattern": "[^\\s\\S]"},
])
def test_a_schema_no_value_matches_is_400(http, schema):
    """Once answered 200 with empty content: the grammar allowed no token (or none after ``[``)."""
    _refused(_complete(http, guided_json=schema), "guided_json", "no JSON value matches")
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    response = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 4, "response_format": fmt,
                                                        "messages": [{"role": "user", "content": "Hi"}]})
    _refused(response, "response_format", "no JSON value matches")


def test_a_pattern_no_string_matches_is_400(http):
    _refused(_complete(http, guided_regex="[^\\s\\S]"), "guided_regex", "no string matches")
    _refused(_complete(http, guided_regex="a[^\\x00-\\U0010FFFF]"), "guided_regex", "no string matches")


def test_local_refs_and_optional_recursion_still_work(http):
    schema = {"$defs": {"name": {"type": "string", "maxLength": 8},
                        "node": {"type": "object", "properties": {"name": {"$ref": "#/$defs/name"},
                                                                  "kids": {"type": "array", "maxItems": 2,
                                                                           "items": {"$ref": "#/$defs/node"}}},
                                 "required": ["name"]}},
              "$ref": "#/$defs/node"}
    response = _complete(http, guided_json=schema, max_tokens=200, temperature=1.0, seed=5)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        jsonschema.validate(json.loads(choice["text"]), schema)
    assert choice["text"].startswith('{"name":"')          # compact: no space after ':' or ','


def test_prompt_schema_past_the_context_is_400(http):
    params = "".join(f'<param name="p{i}" len="4096"/>' for i in range(1000))
    pml = f'<schema name="huge"><module name="m">{params}</module></schema>'
    response = http.post("/v1/schemas", json={"schema": pml})
    _refused(response, "schema", "4096000 positions", "context")
    assert http.get("/v1/schemas/huge").status_code == 404
