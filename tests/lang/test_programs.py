"""Every element of the DSL against a real radixrelay server with the default model."""

from __future__ import annotations

import itertools

import httpx
import pytest

import radixrelay.lang as rl
from radixrelay.text.chat_template import ChatTemplate
from tests.lang import reference
from tests.lang.test_select import CASES as SELECT_CASES

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
PAGE_SIZE = 16         # the server's default: the radix cache shares whole pages
SHARED = ("A short story. Mia lives in a small house by the sea with her old grey cat, "
          "and every morning she walks along the beach to look for shells. ")


@rl.function
def complete(s, text, **gen_args):
    s += text
    s += rl.gen("out", **gen_args)


def test_text_gen_stop_and_usage(endpoint):
    state = complete.run(text="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=",", backend=endpoint)
    out = state["out"]
    assert out.strip() == "5"                          # greedy, cut before the stop string
    assert state.text() == "1, 2, 3, 4," + out
    meta = state.meta("out")
    assert meta.finish_reasons == ("stop",)
    assert meta.usage is not None and meta.usage.prompt_tokens == len(reference.tokenizer().encode("1, 2, 3, 4,"))
    assert meta.started < meta.finished


def test_gen_n_top_p_and_max_tokens(endpoint):
    state = complete.run(text="Once upon a time", max_tokens=3, temperature=1.0, top_p=0.9, n=3,
                         backend=endpoint)
    outs = state["out"]
    assert isinstance(outs, list) and len(outs) == 3
    assert state.text() == "Once upon a time"           # n > 1: the text is not extended
    assert state.meta("out").usage.completion_tokens <= 9
    assert state.meta("out").finish_reasons == ("length",) * 3


def test_gen_with_regex_json_schema_and_choices(endpoint):
    import json
    import re

    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                               "score": {"type": "integer", "minimum": 1, "maximum": 5}},
              "required": ["answer", "score"]}

    @rl.function
    def constrained(s):
        s += "Phone: "
        s += rl.gen("phone", regex=r"\d{3}-\d{4}", max_tokens=16, temperature=0.8)
        s += "\nCity: "
        s += rl.gen("city", choices=["Paris", "Rome"], max_tokens=8, temperature=0)
        s += "\nVerdict: "
        s += rl.gen("verdict", json_schema=schema, max_tokens=40, temperature=0)

    state = constrained.run(backend=endpoint)
    assert re.fullmatch(r"\d{3}-\d{4}", state["phone"]) and state["city"] in ("Paris", "Rome")
    verdict = json.loads(state["verdict"])
    assert verdict["answer"] in ("yes", "no") and 1 <= verdict["score"] <= 5
    assert state.meta("verdict").finish_reasons == ("stop",)


def test_a_backend_without_structured_outputs_refuses_them(server):
    backend = rl.OpenAICompatible(f"{server.base_url}/v1", model="default", structured_outputs=False)
    try:
        with pytest.raises(rl.ProgramError, match="no structured outputs"):
            complete.run(text="x", regex="a+", max_tokens=4, backend=backend)
    finally:
        backend.close()


def test_roles_render_with_the_model_chat_template(endpoint):
    @rl.function
    def chat(s):
        s += rl.system("You answer in one word.")
        s += rl.user("Capital of France?")
        s += rl.assistant(rl.gen("answer", max_tokens=4, temperature=0))

    state = chat.run(backend=endpoint)
    template = ChatTemplate.for_tokenizer(reference.tokenizer())
    expected = template.render([{"role": "system", "content": "You answer in one word."},
                                {"role": "user", "content": "Capital of France?"},
                                {"role": "assistant", "content": state["answer"]}],
                               add_generation_prompt=False)
    assert state.text() == expected
    assert state["answer"]


def test_fork_branches_run_concurrently_and_reuse_the_prefix(endpoint):
    joined: list[rl.ProgramState] = []

    @rl.function
    def branches(s):
        s += SHARED
        forks = s.fork(4)
        for i, f in enumerate(forks):
            f += f"Chapter {i + 1}:"
            f += rl.gen("next", max_tokens=6, temperature=0.8)
        joined.extend(forks.join())
        assert forks["next"] == [f["next"] for f in forks]

    branches.run(backend=endpoint)
    forks = joined
    metas = [f.meta("next") for f in forks]
    # Concurrent, not sequential: every pair of request intervals overlaps.
    for a, b in itertools.combinations(metas, 2):
        assert a.started < b.finished and b.started < a.finished, (a, b)
    # Every branch found the shared text in the radix cache (whole pages of it).
    shared_tokens = len(reference.tokenizer().encode(SHARED)) - 1   # the boundary token may merge
    for meta in metas:
        assert meta.usage.cached_tokens >= shared_tokens // PAGE_SIZE * PAGE_SIZE > 0, meta.usage
    assert all(f.text().startswith(SHARED + f"Chapter {i + 1}:") for i, f in enumerate(forks))


def test_streaming_a_gen(endpoint):
    @rl.function
    def story(s):
        s += "Write one sentence about the sea:"
        s += rl.gen("line", max_tokens=8, temperature=0)

    state = story.run(backend=endpoint, stream=True)
    chunks = list(state.text_iter("line"))
    assert len(chunks) > 1
    assert "".join(chunks) == state["line"]
    everything = "".join(state.text_iter())
    assert everything == state.text()


def test_run_batch_of_20_with_progress_bar(endpoint, capsys):
    inputs = [{"text": f"{i} + {i} =", "max_tokens": 2, "temperature": 0} for i in range(20)]
    states = complete.run_batch(inputs, backend=endpoint, num_threads=20, progress_bar=True)
    assert len(states) == 20 and all(s.error is None for s in states)
    for i, s in enumerate(states):
        assert s.text() == f"{i} + {i} =" + s["out"]
    assert "20/20" in capsys.readouterr().err


def test_errors_name_the_program_line(endpoint):
    @rl.function
    def too_long(s):
        s += "Hello"
        s += rl.gen("x", max_tokens=10**6)
        s += rl.gen("y", max_tokens=2)        # skipped after the failure

    with pytest.raises(rl.ProgramError) as info:
        too_long.run(backend=endpoint)
    assert "rl.gen(\"x\", max_tokens=10**6)" in str(info.value)
    assert "server answered 400" in info.value.reason
    assert info.value.origin.lineno == too_long.func.__code__.co_firstlineno + 3

    @rl.function
    def bad_choices(s):
        s += rl.select("x", choices=["same", "same"])

    with pytest.raises(rl.ProgramError, match=r"bad_choices: .*choices repeat"):
        bad_choices.run(backend=endpoint)

    @rl.function
    def failing_branch(s):
        s += "Hi"
        forks = s.fork(2)
        forks[1] += rl.gen("x", max_tokens=10**6)
        forks.join()

    with pytest.raises(rl.ProgramError, match=r"forks\[1\] \+= rl\.gen"):
        failing_branch.run(backend=endpoint)

    states = too_long.run_batch([{}], backend=endpoint)
    assert isinstance(states[0].error, rl.ProgramError)
    with pytest.raises(rl.ProgramError):
        states[0]["x"]


def test_openai_compatible_backend_with_plain_roles(server):
    backend = rl.OpenAICompatible(f"{server.base_url}/v1", model="default", api_key="unused")
    try:
        @rl.function
        def chat(s):
            s += rl.user("Say hi.")
            s += rl.assistant(rl.gen("answer", max_tokens=3, temperature=0))

        state = chat.run(backend=backend)
        assert state.text() == f"User: Say hi.\nAssistant: {state['answer']}\n"
    finally:
        backend.close()


def test_reference_agrees_with_the_server_next_token_logprobs(server):
    """The by-hand reference (transformers on the same GGUF) matches radixrelay's own logprobs: the
    server's logprob of " Paris" is transformers' (``reference.PARIS_LOGPROB``, which test_select.py
    checks the reference computes; loading transformers' model here as well would double its cost)."""
    response = httpx.post(f"{server.base_url}/v1/completions", timeout=120, json={
        "model": "default", "prompt": reference.PARIS_PROMPT, "max_tokens": 1, "temperature": 0,
        "logprobs": 5}).json()
    top = response["choices"][0]["logprobs"]["top_logprobs"][0]
    assert top[reference.PARIS] == pytest.approx(reference.PARIS_LOGPROB, abs=2e-3)


@pytest.fixture(scope="module")
def fresh_logprobs(server):
    """By-hand prompt logprobs: each sequence alone in its own /v1/completions request (echo +
    logprobs), under a cache salt of its own, so that nothing of it is cached and every logprob is
    computed afresh. (That the server's echoed prompt logprobs equal the offline Engine's
    ``prompt_logprobs`` is checked by tests/server/test_api.py::test_server_equals_offline_engine;
    that they agree with transformers, by test_reference_agrees_with_the_server_next_token_logprobs.)"""
    salts = itertools.count()

    def logprobs_of(ids: list[int]) -> list[float | None]:
        response = httpx.post(f"{server.base_url}/v1/completions", timeout=120, json={
            "model": "default", "prompt": ids, "max_tokens": 1, "temperature": 0, "echo": True,
            "logprobs": 0, "cache_salt": f"by-hand-{next(salts)}"})
        response.raise_for_status()
        choice = response.json()["choices"][0]
        assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        return choice["logprobs"]["token_logprobs"][:len(ids)]

    return logprobs_of


@pytest.mark.parametrize(("prefix", "choices"), [SELECT_CASES[0], SELECT_CASES[-1]])
def test_select_on_radixrelay(endpoint, fresh_logprobs, prefix, choices):
    """select scores from radixrelay's prompt logprobs (one /v1/completions request with echo + logprobs
    for the prefix and every choice, sharing the cached prefix) equal the scores computed by hand from
    each sequence's logprobs computed alone and uncached: two of the cases of test_select.py (checked
    there against transformers through a stand-in server, all four), a plain one and the BPE merge
    across the boundary (the others take the same path with other lengths)."""
    @rl.function
    def pick(s):
        s += prefix
        s += rl.select("answer", choices=choices)

    state = pick.run(backend=endpoint)
    scores = reference.choice_scores(prefix, choices, fresh_logprobs)
    assert state["answer"] == choices[max(range(len(choices)), key=lambda i: scores[i])]
    assert state.meta("answer").scores == pytest.approx(scores, abs=1e-4)
