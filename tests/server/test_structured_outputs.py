"""Structured outputs over HTTP with the official openai client: ``response_format`` (json_object,
json_schema) and the ``guided_*`` extensions, on chat and completions, streaming and not, with n > 1,
stop strings, max_tokens and logprobs. Bad constraints are 400s (``test_hostile_input.py``)."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.server.conftest import MODEL

pytestmark = pytest.mark.timeout(300)
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "pets": {"type": "array", "items": {"enum": ["cat", "dog"]},
                                                    "maxItems": 2}},
          "required": ["name", "age", "pets"]}
QUESTION = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def client(hostile_server):
    return openai.OpenAI(base_url=f"{hostile_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_chat_json_schema_streaming_and_not(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    full = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=80, temperature=0,
                                          response_format=fmt)
    choice = full.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=80, temperature=0,
                                            response_format=fmt, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == choice.message.content


def test_samples_all_follow_the_schema(client):
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=80, temperature=1.0, n=4,
                                         seed=3, extra_body={"guided_json": PERSON})
    assert len(out.choices) == 4
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_object_with_logprobs(client):
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=60, temperature=0,
                                         response_format={"type": "json_object"}, logprobs=True, top_logprobs=2)
    choice = out.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    assert choice.message.content.startswith("{") and choice.logprobs.content
    assert all(lp.logprob > float("-inf") and len(lp.top_logprobs) == 2 for lp in choice.logprobs.content)


def test_completions_regex_and_choice(client):
    regex = client.completions.create(model=MODEL, prompt="Call me at", max_tokens=20, temperature=0.9, n=3, seed=1,
                                      extra_body={"guided_regex": r"\d{3}-\d{4}"})
    assert all(re.fullmatch(r"\d{3}-\d{4}", c.text) and c.finish_reason == "stop" for c in regex.choices)
    choices = ["Paris", "London", "Rome"]
    picked = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0,
                                       extra_body={"guided_choice": choices})
    assert picked.choices[0].text in choices and picked.choices[0].finish_reason == "stop"
    stream = client.completions.create(model=MODEL, prompt="Call me at", max_tokens=20, temperature=0, stream=True,
                                       extra_body={"guided_regex": r"\d{3}-\d{4}"})
    assert re.fullmatch(r"\d{3}-\d{4}", "".join(c.choices[0].text for c in stream if c.choices))


def test_stop_strings_and_max_tokens_still_apply(client):
    stopped = client.completions.create(model=MODEL, prompt="Call me at", max_tokens=20, temperature=0, stop=["-"],
                                        extra_body={"guided_regex": r"\d{3}-\d{4}"})
    assert re.fullmatch(r"\d{3}", stopped.choices[0].text) and stopped.choices[0].finish_reason == "stop"
    cut = client.completions.create(model=MODEL, prompt="A list:", max_tokens=3, temperature=0,
                                    extra_body={"guided_regex": r"[a-z ]{200}"})
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 3


def test_constrained_requests_batch_with_free_ones(hostile_server, client):
    """The same greedy unconstrained request, alone and beside constrained ones at once."""
    alone = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
    import concurrent.futures as cf

    def constrained(i: int) -> str:
        return client.completions.create(model=MODEL, prompt=f"Person {i}:", max_tokens=60, temperature=0.8, seed=i,
                                         extra_body={"guided_json": PERSON}).choices[0].text

    with cf.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(constrained, i) for i in range(3)]
        beside = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0,
                                           extra_body={"ignore_eos": True}).choices[0].text
        for f in futures:
            jsonschema.validate(json.loads(f.result()), PERSON)
    assert beside == alone
    gauges = httpx.get(f"{hostile_server.base_url}/metrics").text
    assert "radixrelay_num_requests_running 0.0" in gauges
