"""``POST /tokenize`` and ``/detokenize`` on the real server (default model): the ids a completion or a
chat request would be served with, the text of ids, and 400s naming the field for bad input."""

from __future__ import annotations

import httpx
import openai
import pytest

from radixrelay.model.model_registry import resolve_model_path
from radixrelay.text.chat_template import ChatTemplate
from radixrelay.text.tokenizer import load_tokenizer
from tests.server.conftest import HOSTILE_TEMPLATE, MODEL

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def http(hostile_server):
    with httpx.Client(base_url=hostile_server.base_url, timeout=60) as h:
        yield h


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_path("default"))


def test_a_prompt_tokenizes_as_a_completion_serves_it(http, hostile_server, tokenizer) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    out = http.post("/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True}).json()
    assert out["tokens"] == tokenizer.encode(text) and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == http.get("/v1/models").json()["data"][0]["max_model_len"]
    assert out["token_strs"] == [tokenizer.id_to_token(t) for t in out["tokens"]]
    client = openai.OpenAI(base_url=f"{hostile_server.base_url}/v1", api_key="none")
    served = client.completions.create(model=MODEL, prompt=text, max_tokens=1)
    assert served.usage.prompt_tokens == out["count"]
    bare = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == tokenizer.encode(text, add_special_tokens=False) and bare["token_strs"] is None


def test_messages_tokenize_with_the_servers_chat_template(http, hostile_server, tokenizer) -> None:
    rendered = ChatTemplate.for_tokenizer(tokenizer, HOSTILE_TEMPLATE).render(MESSAGES)
    out = http.post("/tokenize", json={"messages": MESSAGES}).json()
    assert out["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    client = openai.OpenAI(base_url=f"{hostile_server.base_url}/v1", api_key="none")
    served = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    assert served.usage.prompt_tokens == out["count"]
    open_end = http.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert open_end["count"] < out["count"]


def test_detokenize_gives_the_text_back(http, tokenizer) -> None:
    text = "<|im_start|>user\nHello, world!"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert http.post("/detokenize", json={"tokens": ids, "model": MODEL}).json() == {"prompt": text}
    assert http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
    ("/tokenize", {"prompt": "a", "temperature": 1}, None),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": [10 ** 9]}, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, "tokens"),
    ("/detokenize", {}, None),
])
def test_bad_input_is_a_400_naming_the_field(http, path, body, param) -> None:
    reply = http.post(path, json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param, error


def test_malformed_and_oversized_bodies(http) -> None:
    reply = http.post("/tokenize", content=b"{", headers={"content-type": "application/json"})
    assert reply.status_code == 400 and "not valid JSON" in reply.json()["error"]["message"]
    reply = http.post("/tokenize", content=b"x" * (5 << 20), headers={"content-type": "application/json"})
    assert reply.status_code == 413
