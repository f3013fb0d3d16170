"""Schema-driven fuzzing of the real server: schemathesis generates requests for every operation
in /openapi.json, valid ones (which must be served: the schema is accurate) and invalid ones (which
must be refused with a 4xx OpenAI error). Never a 5xx, never a hang; after each batch /health is
200 and a normal request is served. Every response must match what the schema documents."""

from __future__ import annotations

from collections import Counter

import httpx
import pytest

from tests.server import hostile
from tests.server.conftest import MAX_N, MODEL
from tests.server.hostile import Tally, check_alive, fuzz

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]
BATCH = 20            # generated cases per batch; two valid batches, two invalid ones (the valid batches of
                      # seeds 1 and 2 reach every operation, every prompt form, several messages, n > 1,
                      # logprobs, stop and structured-output constraints)
TIMEOUT = 30.0        # seconds a request may take before it counts as a hang
# Valid bodies are tamed harder than hostile.py's defaults (which the longer benchmark runs keep): a
# valid case costs a forward pass of the model per generated token, so it generates one token (the
# request still goes through parsing, validation, the template, tokenizing, scheduling, sampling and the
# response, streamed or not); shorter strings and fewer prompts and messages are the same kinds of
# request (a string, a token-id list, a list of prompts, several messages).
TAME = {"MAX_TOKENS": 1, "MAX_CHARS": 60, "MAX_PROMPTS": 2, "MAX_MESSAGES": 2, "MAX_PROMPT_IDS": 16}


@pytest.fixture(scope="module", autouse=True)
def _tamer():
    with pytest.MonkeyPatch.context() as mp:
        for name, value in TAME.items():
            mp.setattr(hostile, name, value)
        yield


@pytest.fixture(scope="module")
def schema_doc(hostile_server):
    return httpx.get(f"{hostile_server.base_url}/openapi.json").json()


class _Tally(Tally):
    """A tally that also counts the operations (``METHOD path``) its cases went to."""

    def __init__(self) -> None:
        super().__init__()
        self.operations: Counter[str] = Counter()

    def record(self, label: str, *args) -> None:
        self.operations[" ".join(label.split(" ", 2)[:2])] += 1
        super().record(label, *args)


def _operations(schema_doc, *, with_body: bool = False) -> set[str]:
    return {f"{method.upper()} {path}" for path, methods in schema_doc["paths"].items()
            for method, operation in methods.items() if not with_body or "requestBody" in operation}


def _run(server, schema_doc, *, negative: bool, cases: int,
         seeds: tuple[int, ...]) -> tuple[Tally, Counter[str]]:
    total, operations = Tally(), Counter()
    with httpx.Client(base_url=server.base_url, timeout=TIMEOUT) as http:
        for seed in seeds:
            part = _Tally()
            fuzz(server.base_url, schema_doc, cases=cases, seed=seed, negative=negative,
                 timeout=TIMEOUT, tally=part)
            operations.update(part.operations)
            check_alive(http, MODEL, part)
            total.merge(part)
    return total, operations


def test_valid_generated_requests_are_served(hostile_server, schema_doc):
    tally, operations = _run(hostile_server, schema_doc, negative=False, cases=BATCH, seeds=(1, 2))
    assert tally.tried >= 2 * BATCH * 0.9
    assert set(operations) == _operations(schema_doc), operations      # every operation was tried
    assert tally.server_errors == 0 and tally.hangs == 0
    assert tally.problems == []              # includes every response matching the schema
    assert tally.health_passed == tally.health_checks == 2
    # The schema is accurate: what it calls valid is served. What it cannot express: a prompt plus
    # max_tokens past the context, and structured-output constraints the grammar engine refuses
    # (random regexes and schemas, tool schemas included, and a tool_choice naming a function its tools
    # do not have): those are 400s naming their field, with the engine's message.
    constraints = sum(tally.refused_params[f] for f in ("guided_json", "guided_regex", "guided_choice",
                                                         "response_format", "tools", "tool_choice"))
    assert tally.by_class["2xx"] + constraints >= 0.95 * tally.tried, (tally.by_status, tally.refused_params)


def test_invalid_generated_requests_get_4xx(hostile_server, schema_doc):
    tally, operations = _run(hostile_server, schema_doc, negative=True, cases=BATCH, seeds=(3, 4))
    assert tally.tried >= 2 * BATCH * 0.9
    assert set(operations) >= {"POST /v1/chat/completions", "POST /v1/completions"}, operations
    assert tally.server_errors == 0 and tally.hangs == 0
    assert tally.problems == []
    assert tally.health_passed == tally.health_checks == 2
    assert tally.by_class["4xx"] >= 0.8 * tally.tried, tally.by_status


def test_schema_documents_every_endpoint(schema_doc):
    paths = schema_doc["paths"]
    schemas = schema_doc["components"]["schemas"]
    for path, method in (("/v1/chat/completions", "post"), ("/v1/completions", "post"),
                         ("/v1/models", "get"), ("/health", "get"), ("/metrics", "get"),
                         ("/flush_cache", "post")):
        responses = paths[path][method]["responses"]
        assert "200" in responses and all("content" in r for r in responses.values()), path
    for path, body in (("/v1/chat/completions", "ChatCompletionRequest"),
                       ("/v1/completions", "CompletionRequest")):
        ref = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{body}"
        props = schemas[body]["properties"]
        assert props["model"] == {"enum": [MODEL]}
        assert props["n"]["maximum"] == MAX_N
        assert props["max_tokens"]["anyOf"][0]["maximum"] == 8191      # the model's context - 1
        assert props["logit_bias"]["anyOf"][0]["maxProperties"] == 300
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert chat["tools"]["anyOf"][0] == {"type": "array", "items": {"$ref": "#/components/schemas/Tool"},
                                         "maxItems": 128}
    assert chat["messages"]["items"] == {"$ref": "#/components/schemas/MessageParam"}
    assert set(schemas["ErrorResponse"]["required"]) == {"error"}
