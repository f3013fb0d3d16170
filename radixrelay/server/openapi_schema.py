"""The OpenAPI document served at /openapi.json: every endpoint's request body and responses.

The endpoints read their bodies themselves (msgspec, not pydantic), so FastAPI knows nothing about
them; this module builds the schemas from the same msgspec structs the server decodes and encodes,
then narrows them to what this server accepts: the served model name, ``n <= --max-n``,
``max_tokens`` within the context, token ids within the vocabulary, and the no-op values of the
OpenAI fields it does not implement (``openai_protocol.UNSUPPORTED``). Invariant: a body valid
against the published schema is accepted (as long as the prompt plus ``max_tokens`` fits the
context, which a schema cannot express), so schema-driven fuzzing finds defects, not noise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
from fastapi.openapi.utils import get_openapi
from starlette.routing import BaseRoute

from radixrelay.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS
from radixrelay.server import openai_protocol as oa
from radixrelay.server import tokenize_api as tk

_REF = "#/components/schemas/{name}"
KEYED_PATHS = ("/flush_cache", "/tokenize", "/detokenize")    # besides /v1/*: need the API key if there is one
_TYPES = (oa.ChatCompletionRequest, oa.CompletionRequest, oa.MessageParam, oa.ChatCompletion,
          oa.ChatCompletionChunk, oa.Completion, oa.ModelList, oa.ErrorResponse, oa.Health,
          oa.Flushed, tk.TokenizeRequest, tk.TokenizeResponse, tk.DetokenizeRequest, tk.DetokenizeResponse)


@dataclass(frozen=True)
class Limits:
    """What the running server accepts beyond the structs' static ranges."""

    model_name: str
    max_n: int
    max_context: int      # tokens: prompt + max_tokens must fit
    vocab_size: int
    api_key: bool         # /v1/*, /flush_cache, /tokenize and /detokenize need a bearer token
    priority: bool = False    # --enable-priority: any integer priority (else only 0)


def _ref(cls: type) -> dict[str, str]:
    return {"$ref": _REF.format(name=cls.__name__)}


def _json(cls: type, description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref(cls)}}}


_ERRORS = {
    "400": "invalid parameters (the message names the field: `param`)",
    "401": "missing or wrong API key (when the server has one)",
    "413": "body over --max-body-bytes",
    "415": "Content-Type is not JSON",
    "429": "the waiting queue is full",
    "503": "draining, or a runtime process died",
}


def _errors(*codes: str) -> dict[str, Any]:
    return {code: _json(oa.ErrorResponse, _ERRORS[code]) for code in codes}


def _generation_responses(result: type, chunk: type) -> dict[str, Any]:
    ok = _json(result, f"the {result.__name__}; with `stream: true` an SSE stream of "
                       f"{chunk.__name__} events ending with `data: [DONE]`")
    ok["content"]["text/event-stream"] = {}      # events: `data: <chunk JSON>`, then `data: [DONE]`
    return {"200": ok, **_errors("400", "401", "413", "415", "429", "503")}


def _request_body(cls: type) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": _ref(cls)}}}


def _narrow_generation(props: dict[str, Any], limits: Limits, table: dict[str, oa.Unsupported]) -> None:
    """Patch the limits of one generation request's properties (shared by both endpoints)."""
    props["model"] = {"enum": [limits.model_name]}
    props["n"] = {"type": "integer", "minimum": 1, "maximum": limits.max_n, "default": 1}
    tokens = {"anyOf": [{"type": "integer", "minimum": 1, "maximum": limits.max_context - 1},
                        {"type": "null"}]}
    props["max_tokens"] = tokens
    props["stop"] = {"anyOf": [{"type": "string", "minLength": 1},
                               {"type": "array", "items": {"type": "string", "minLength": 1}},
                               {"type": "null"}]}
    props["stop_token_ids"] = {"anyOf": [{"type": "array", "items": _token(limits), "maxItems": MAX_STOP_TOKEN_IDS},
                                         {"type": "null"}]}
    props["logit_bias"] = {"anyOf": [{"type": "object", "propertyNames": {"pattern": "^(0|[1-9][0-9]{0,18})$"},
                                      "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                                      "maxProperties": MAX_LOGIT_BIAS}, {"type": "null"}]}
    # Valid names are those registered at request time (POST /v1/schemas), which a static schema
    # cannot list: published as null only, like the no-op values of unsupported fields.
    props["prompt_schema"] = {"type": "null", "description": "extension: the name of a schema "
                              "registered with POST /v1/schemas (modular prompt reuse; see the README)"}
    if not limits.priority:
        props["priority"] = {"const": 0, "description": "smaller runs first; only 0 without --enable-priority"}
    for name, unsupported in table.items():
        props[name] = {**unsupported.schema, "description": f"unsupported: {unsupported.why}; "
                                                            "only the values that change nothing"}


def _token(limits: Limits) -> dict[str, Any]:
    return {"type": "integer", "minimum": 0, "maximum": limits.vocab_size - 1}


def _narrow(components: dict[str, Any], limits: Limits) -> None:
    chat = components["ChatCompletionRequest"]["properties"]
    _narrow_generation(chat, limits, dict(oa.UNSUPPORTED["chat"]))
    chat["messages"] = {"type": "array", "items": _ref(oa.MessageParam), "minItems": 1}
    chat["chat_template_kwargs"] = {"anyOf": [
        {"type": "object", "propertyNames": {"not": {"enum": list(oa.RESERVED_TEMPLATE_VARS)}}}, {"type": "null"}],
        "description": "extra variables for the chat template (e.g. enable_thinking)"}
    components["MessageParam"]["allOf"] = [
        {"if": {"properties": {"role": {"const": "tool"}}},
         "then": {"required": ["tool_call_id"], "properties": {"tool_call_id": {"type": "string", "minLength": 1}}}},
        {"if": {"properties": {"role": {"not": {"const": "assistant"}}}},
         "then": {"properties": {"content": {"not": {"type": "null"}}, "tool_calls": {"type": "null"}}}},
    ]
    chat["max_completion_tokens"] = chat["max_tokens"]
    components["ChatCompletionRequest"]["if"] = {
        "properties": {"top_logprobs": {"type": "integer"}}, "required": ["top_logprobs"]}
    components["ChatCompletionRequest"]["then"] = {
        "properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}
    tokenize = components["TokenizeRequest"]
    tokenize["properties"]["model"] = {"anyOf": [{"enum": [limits.model_name]}, {"type": "null"}]}
    tokenize["properties"]["messages"] = {"anyOf": [
        {"type": "array", "items": _ref(oa.MessageParam), "minItems": 1}, {"type": "null"}]}
    tokenize["oneOf"] = [   # a prompt (text) or messages, not both
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}, "messages": {"type": "null"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}, "prompt": {"type": "null"}}}]
    tokenize["properties"]["chat_template_kwargs"] = chat["chat_template_kwargs"]
    detokenize = components["DetokenizeRequest"]["properties"]
    detokenize["model"] = tokenize["properties"]["model"]
    detokenize["tokens"] = {"type": "array", "items": _token(limits)}
    completion = components["CompletionRequest"]["properties"]
    _narrow_generation(completion, limits, dict(oa.UNSUPPORTED["completions"]))
    completion["max_tokens"] = {**completion["max_tokens"], "description": "default 16; 0 is also "
                                "accepted with `echo` (the prompt only)"}
    token = _token(limits)
    completion["prompt"] = {"anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": token, "minItems": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
        {"type": "array", "items": {"type": "array", "items": token, "minItems": 1}, "minItems": 1},
    ]}


def build(routes: list[BaseRoute], version: str, limits: Limits) -> dict[str, Any]:
    doc = get_openapi(title="radixrelay", version=version, routes=routes,
                      description="OpenAI-compatible LLM server with a radix prefix cache")
    _, components = msgspec.json.schema_components(_TYPES, ref_template=_REF)
    _narrow(components, limits)
    doc.setdefault("components", {})["schemas"] = components
    guarded = _errors("401") if limits.api_key else {}
    operations: dict[tuple[str, str], dict[str, Any]] = {
        ("/v1/chat/completions", "post"): {
            "requestBody": _request_body(oa.ChatCompletionRequest),
            "responses": _generation_responses(oa.ChatCompletion, oa.ChatCompletionChunk)},
        ("/v1/completions", "post"): {
            "requestBody": _request_body(oa.CompletionRequest),
            "responses": _generation_responses(oa.Completion, oa.Completion)},
        ("/v1/models", "get"): {
            "responses": {"200": _json(oa.ModelList, "the served model"), **guarded,
                          **_errors("503")}},
        ("/health", "get"): {
            "responses": {"200": _json(oa.Health, "ready"),
                          "503": _json(oa.Health, "draining, or a runtime process died")}},
        ("/metrics", "get"): {
            "responses": {"200": {"description": "Prometheus text format",
                                  "content": {"text/plain": {"schema": {"type": "string"}}}}}},
        ("/tokenize", "post"): {
            "requestBody": _request_body(tk.TokenizeRequest),
            "responses": {"200": _json(tk.TokenizeResponse, "the ids the server would serve"), **guarded,
                          **_errors("400", "413", "415", "503")}},
        ("/detokenize", "post"): {
            "requestBody": _request_body(tk.DetokenizeRequest),
            "responses": {"200": _json(tk.DetokenizeResponse, "the text of the ids"), **guarded,
                          **_errors("400", "413", "415", "503")}},
        ("/flush_cache", "post"): {
            "responses": {"200": _json(oa.Flushed, "the radix cache is empty"), **guarded,
                          "409": _json(oa.ErrorResponse, "requests are running"),
                          **_errors("503")}},
    }
    for (path, method), operation in operations.items():
        doc["paths"][path][method].update(operation)
        if limits.api_key and (path.startswith("/v1/") or path in KEYED_PATHS):
            doc["paths"][path][method]["security"] = [{"bearer": []}]
    if limits.api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return doc
