"""Incremental detokenization (deltas concatenate to the full decode) and stop strings."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixrelay.text.detokenizer import IncrementalDetokenizer
from radixrelay.text.tokenizer import Tokenizer, load_tokenizer
from tests.text.test_tokenizer import CORPUS, default_gguf
from tests.text.test_tokenizer_formats import SAMPLES, TRAINING_TEXT, sp_model  # noqa: F401 (fixture)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer(default_gguf())


def stream(tok: Tokenizer, ids: list[int], *, chunk: int = 1, skip: bool = True, context=()) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip, context_ids=context)
    deltas = [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return [*deltas, detok.finish()]


@pytest.mark.parametrize("text", CORPUS)
def test_deltas_concatenate_to_text(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    for chunk in (1, 3):
        deltas = stream(tok, ids, chunk=chunk, skip=False)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=False)
        assert all("\ufffd" not in d for d in deltas)  # valid text: no replacement char, ever


def test_multibyte_character_is_held_until_complete(tok: Tokenizer) -> None:
    ids = tok.encode("😀")
    assert len(ids) > 1  # the emoji spans several byte tokens
    detok = IncrementalDetokenizer(tok)
    assert [detok.add([i]) for i in ids] == [""] * (len(ids) - 1) + ["😀"]


def test_incomplete_tail_is_released_at_finish(tok: Tokenizer) -> None:
    ids = tok.encode("ok 😀")[:-1]
    deltas = stream(tok, ids)
    assert "".join(deltas[:-1]) == "ok" and deltas[-1] == tok.decode(ids)[2:]


def test_context_keeps_leading_space(tok: Tokenizer) -> None:
    prompt, output = tok.encode("Say:"), tok.encode(" hello there")
    assert "".join(stream(tok, output, context=prompt)) == " hello there"


def test_prompt_ending_inside_a_character(tok: Tokenizer) -> None:
    ids = tok.encode("Say 😀")
    prompt, output = ids[:-1], ids[-1:] + tok.encode("ok")  # the emoji's last byte starts the output
    assert tok.decode(prompt).endswith("\ufffd")
    assert "".join(stream(tok, output, context=prompt)) == tok.decode(output) == "\ufffdok"


def test_sentencepiece_leading_spaces(sp_model) -> None:  # noqa: F811 (fixture)
    tok = load_tokenizer(sp_model)
    for text in [*SAMPLES, *TRAINING_TEXT[:5], " leading space", "a  b   c"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert "".join(stream(tok, ids)) == tok.decode(ids)
        prompt = tok.encode("Say:")
        whole = tok.decode(prompt + ids)
        assert "".join(stream(tok, ids, context=prompt)) == whole[len(tok.decode(prompt)) :]
    # "▁the ▁cat" after a prompt keeps its first space; a bare decode strips it
    output = tok.encode("the cat", add_special_tokens=False)
    assert "".join(stream(tok, output)) == "the cat"
    assert "".join(stream(tok, output, context=tok.encode("x"))) == " the cat"


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), length=st.integers(1, 40), chunk=st.integers(1, 4))
def test_random_token_sequences(tok: Tokenizer, seed: int, length: int, chunk: int) -> None:
    """Any ids at all, including byte tokens that never form valid UTF-8 and special tokens."""
    rng = random.Random(seed)
    ids = [rng.randrange(tok.vocab_size) if rng.random() < 0.7 else rng.randrange(100, 400) for _ in range(length)]
    for skip in (True, False):
        assert "".join(stream(tok, ids, chunk=chunk, skip=skip)) == tok.decode(ids, skip_special_tokens=skip)
