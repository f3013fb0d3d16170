"""The one admission path of the server and the Engine (``radixrelay.admission``): token-id checks, the
max_tokens rules, truncation (arrays and lists alike), text encoding with its bound, schema prompts' fit.
Every refusal is an ``AdmissionError`` (a ``ValueError``) naming its field."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import pytest

from radixrelay.admission import EXACT_COUNT_FACTOR, Admission, AdmissionError, Budget, Limits, checked_ids
from radixrelay.radix.truncation import Truncation
from radixrelay.text.tokenizer import load_tokenizer
from tests.text.test_tokenizer import default_gguf

VOCAB = 49152
CONTEXT = 64


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(default_gguf())


def admission(tok, *, kv: int = 48, truncation: bool = False) -> Admission:
    cut = Truncation(0.25, CONTEXT, 4) if truncation else None
    return Admission(tok, Limits(CONTEXT, kv, VOCAB, cut))


def refusal(fn, *args, **kw) -> AdmissionError:
    with pytest.raises(AdmissionError) as info:
        fn(*args, **kw)
    assert isinstance(info.value, ValueError)
    return info.value


def test_token_ids_are_checked_whole_in_numpy():
    for values in ([1, 2, VOCAB - 1], (1, 2, VOCAB - 1), [1.0, 2, VOCAB - 1.0], np.array([1, 2, VOCAB - 1]),
                   np.array([1, 2, VOCAB - 1], dtype=np.uint16), np.array([1.0, 2.0, VOCAB - 1])):
        ids = checked_ids(values, VOCAB)
        assert ids.dtype == np.int32 and ids.tolist() == [1, 2, VOCAB - 1], values
    assert refusal(checked_ids, [], VOCAB).args[0] == "prompt is empty"
    for values in ([4.5], [1, float("nan")], [1, float("inf")], ["x"], [None], [2**70], [[1], [2]], [1, [2]],
                   np.array([True]), np.array([[1, 2]]), 7):
        error = refusal(checked_ids, values, VOCAB, "input")
        assert error.args[0].startswith(f"prompt token ids must be integers in [0, {VOCAB})"), values
        assert error.param == "input"
    for values, bad in (([5, -1], [-1]), ([VOCAB, 3, VOCAB + 1], [VOCAB, VOCAB + 1]), ([2**63], [2**63]),
                        ([1.0, -2.0], [-2.0])):
        assert refusal(checked_ids, values, VOCAB).args[0] == f"prompt token ids out of range [0, {VOCAB}): {bad}"


def test_max_tokens_rules(tok):
    a = admission(tok)                                    # context 64, KV 48
    assert a.max_tokens(10, Budget(5)) == 5
    assert a.max_tokens(10, Budget(None, 16)) == 16       # the endpoint's default
    assert a.max_tokens(10, Budget(None)) == 38           # all the KV cache leaves
    cases = [(64, Budget(1), "prompt", "the prompt has 64 tokens; this model's context is 64 tokens"),
             (48, Budget(None, None, "max_tokens", "messages"), "messages",
              "the prompt has 48 tokens, more than the KV cache holds (48)"),
             (10, Budget(0), "max_tokens", "max_tokens must be >= 1, got 0"),
             (10, Budget(60, None, "max_completion_tokens"), "max_completion_tokens",
              "this model's context is 64 tokens; the prompt (10 tokens) plus max_completion_tokens (60) exceeds it")]
    for length, budget, param, message in cases:
        error = refusal(a.max_tokens, length, budget)
        assert (error.param, error.args[0]) == (param, message)


def test_fit_truncates_arrays_as_lists(tok):
    plain, cut = admission(tok), admission(tok, truncation=True)
    ids = list(range(1, 91))                              # past the context
    assert refusal(plain.fit, np.array(ids, dtype=np.int32), Budget(4)).param == "prompt"
    for form in (ids, np.array(ids, dtype=np.int32)):
        got = cut.fit(form, Budget(4))
        assert got.prompt.ids.dtype == np.int32 and got.max_tokens == 4
        want = Truncation(0.25, CONTEXT, 4).apply(ids, 4)
        assert got.prompt.ids.tolist() == want.ids and got.prompt.dropped == want.dropped
        assert got.prompt.shifted_prefix == want.shifted_prefix and got.prompt.shifted_at == want.shifted_at
        assert isinstance(got.prompt.shifted_prefix, list)
    assert refusal(cut.fit, np.array(ids, dtype=np.int32), Budget(62)).param == "max_tokens"  # no chunk count fits
    short = cut.token_ids([5, 6, 7], Budget(None, 16))
    assert short.prompt.ids.tolist() == [5, 6, 7] and short.prompt.dropped == 0 and short.max_tokens == 16


def test_text_is_encoded_to_int32_with_bos_as_encode_puts_it(tok):
    text = "The capital of France is Paris, and the capital of Spain is Madrid."
    got = admission(tok).text(text, Budget(4))
    assert got.prompt.ids.dtype == np.int32 and got.prompt.ids.tolist() == tok.encode(text)
    with_bos = copy.copy(tok)
    with_bos.add_bos_token, with_bos.bos_token_id = True, 1
    ids = admission(with_bos).text(text, Budget(4)).prompt.ids
    assert ids.tolist() == [1, *tok.encode(text)] == with_bos.encode(text)
    assert admission(with_bos).text(text, Budget(4), add_special_tokens=False).prompt.ids.tolist() == tok.encode(text)
    assert refusal(admission(tok).text, "", Budget(4)).args[0] == "prompt is empty"


def test_a_text_past_twice_the_context_is_refused_as_such(tok):
    text = " ".join(f"word{i}" for i in range(400))       # far past 2 x 64 tokens
    error = refusal(admission(tok).text, text, Budget(4, None, "max_tokens", "messages"))
    assert error.param == "messages"
    assert error.args[0] == f"the prompt has more than {EXACT_COUNT_FACTOR * CONTEXT} tokens; this model's context is 64 tokens"
    kept = admission(tok, truncation=True).text(text, Budget(4))   # truncated instead: the ends kept
    full = tok.encode(text)
    want = Truncation(0.25, CONTEXT, 4).apply(full, 4)
    assert kept.prompt.ids.tolist() == want.ids and kept.prompt.shifted_prefix == want.shifted_prefix


@dataclass
class _Composed:                   # what admission reads of a ComposedPrompt
    token_ids: list[int]
    end_position: int


def test_a_schema_prompt_fits_by_its_positions_and_its_tokens(tok):
    a = admission(tok)
    assert a.composed(_Composed([1] * 20, 30), Budget(None, 16)) == 16
    assert refusal(a.composed, _Composed([1] * 20, 60), Budget(8)).param == "max_tokens"    # 60 + 8 > 64
    assert refusal(a.composed, _Composed([1] * 62, 10), Budget(8)).param == "max_tokens"    # the KV: 62 + 8
    error = refusal(a.composed, _Composed([1] * 4, 64), Budget(1))
    assert error.param == "prompt" and "ends at position 64" in error.args[0]
