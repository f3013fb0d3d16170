"""``select`` against a server that offers prompt logprobs, checked against the by-hand scores."""

from __future__ import annotations

import pytest

import radixrelay.lang as rl
from tests.lang import reference
from tests.lang.stub_server import StubServer

pytestmark = pytest.mark.timeout(300)

CASES = [
    ("The capital of France is", [" Paris", " London", " Berlin"]),
    ("Review: the food was cold and the waiter was rude.\nSentiment:", [" positive", " negative"]),
    ("2 + 2 =", [" 4", " 5", " four"]),
    ("The opposite of hot is co", ["ld", "ol", "lder"]),      # BPE merges across the boundary
]


@pytest.fixture(scope="module")
def stub():
    server = StubServer()
    backend = rl.OpenAICompatible(server.base_url, model="stub")
    yield server, backend
    backend.close()
    server.stop()


@rl.function
def pick(s, prefix, choices):
    s += prefix
    s += rl.select("answer", choices=choices)


@pytest.mark.parametrize(("prefix", "choices"), CASES)
def test_select_matches_the_by_hand_logprobs(stub, prefix, choices):
    server, backend = stub
    state = pick.run(prefix=prefix, choices=choices, backend=backend)
    expected = reference.choice_scores(prefix, choices)
    best = max(range(len(choices)), key=lambda i: expected[i])
    assert state["answer"] == choices[best]
    assert state.text() == prefix + choices[best]
    assert state.meta("answer").scores == pytest.approx(expected, abs=1e-4)
    request = server.requests[-1]                 # one request scores every choice
    assert request["prompt"] == [prefix, *(prefix + c for c in choices)]


def test_the_reference_gives_the_known_logprob():
    """transformers' logprob of a known continuation is the one test_programs.py finds the server giving
    (``reference.PARIS_LOGPROB``): the reference these scores come from agrees with radixrelay's model."""
    ids = reference.tokenizer().encode(reference.PARIS_PROMPT + reference.PARIS)
    assert reference.token_logprobs(ids)[-1] == pytest.approx(reference.PARIS_LOGPROB, abs=1e-4)


def test_a_boundary_merge_counts_the_merged_token(stub):
    """The case list exercises a merge: ``ids(prefix)`` is not a prefix of ``ids(prefix + c)``."""
    tok = reference.tokenizer()
    prefix, choices = CASES[-1]
    merged = [c for c in choices if tok.encode(prefix + c)[:len(tok.encode(prefix))] != tok.encode(prefix)]
    assert merged, "pick a case whose choice merges with the prefix's last token"


def test_few_shot_classifier_in_a_chat(stub):
    _, backend = stub

    @rl.function
    def classify(s, text):
        s += rl.user("Is this review positive or negative? " + text)
        s += rl.assistant(rl.select("label", choices=["positive", "negative"]))

    state = classify.run(text="I loved it, wonderful!", backend=backend)
    assert state["label"] in ("positive", "negative")
    assert state.text().endswith(f"Assistant: {state['label']}\n")   # plain role markers
