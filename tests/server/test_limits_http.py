"""Bounds on what one request may ask of the host, over real HTTP: stop strings (count and length),
JSON-schema repetition keywords and regex counts, ``$ref``s the grammar cannot follow faithfully
(to itself with nothing optional in between, to a URL, to nothing), and prompt schemas whose
positions run past the model's context. At each limit: accepted; past it: a 400 naming the field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from radixrelay.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from radixrelay.structured.spec import MAX_REPETITION
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
