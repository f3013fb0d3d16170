"""Chunked, cached encoding (``radixrelay.text.encode_cache``): the ids are exactly those of one
encode of the whole text, for every pre-tokenizer it accepts; the others encode whole."""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Regex, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from radixrelay.text.encode_cache import _GPT2, _LLAMA3, _QWEN2, ChunkedEncoder, split_text, unchunkable_reason
from radixrelay.text.tokenizer import load_tokenizer
from tests.text.test_tokenizer import CORPUS, default_gguf

# Pieces random texts are made of: words, the places a cut could go wrong (contractions, digits
# next to letters, runs of spaces, newlines, punctuation, non-ASCII letters, special tokens).
PARTS = ["the", "cat", "Sat", "on", "A", "b", " ", " ", " ", "  ", "   ", "\n", "\n\n", "\t", "\r\n",
         "'s", "'T", "don't", "we'll", "12", "3", "2024", ",", ".", "!?", "--", "(x)", "café", "naïve",
         "中文", "😀", "\u00a0", "Ω", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "x1", "1x",
         "\u2581", "Ġ"]


def random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(PARTS) for _ in range(n))


@pytest.fixture(scope="module")
def gguf_tok() -> HFTokenizer:
    return load_tokenizer(default_gguf())._backend._tok


def with_pre(base: HFTokenizer, pre) -> HFTokenizer:
    tok = HFTokenizer.from_str(base.to_str())
    tok.pre_tokenizer = pre
    return tok


def split_then_bytes(*regexes: str):
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
                                   + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


PRE_TOKENIZERS = {
    "smollm (gguf)": None,
    "gpt2 bytelevel": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False),
    "digits + bytelevel": lambda: pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]),
    "gpt2 split": lambda: split_then_bytes(_GPT2),
    "llama3": lambda: split_then_bytes(_LLAMA3),
    "qwen2": lambda: split_then_bytes(_QWEN2),
}


@pytest.mark.parametrize("name", list(PRE_TOKENIZERS))
def test_chunks_encode_like_the_whole_text(gguf_tok: HFTokenizer, name: str) -> None:
    make = PRE_TOKENIZERS[name]
    tok = gguf_tok if make is None else with_pre(gguf_tok, make())
    enc = ChunkedEncoder(tok, chunk_chars=8, max_prefix_bytes=0)        # chunks only
    assert enc.enabled, enc.reason
    rng = random.Random(name)
    texts = [random_text(rng, rng.randrange(1, 120)) for _ in range(300)] + [c * 3 for c in CORPUS]
    for text in texts:
        for t in (text, text + random_text(rng, 5)):      # the second one reuses chunks
            assert enc.encode(t) == tok.encode(t, add_special_tokens=False).ids, repr(t)
    assert enc.hits and enc.misses and not enc.prefix_hits


def test_cut_points() -> None:
    text = "ab cd  ef g1 h\ni j.k lm no"
    pieces = split_text(text, 1)
    assert "".join(pieces) == text
    assert pieces == ["ab", " cd  ef", " g1 h\ni", " j.k", " lm", " no"]
    assert split_text(text, 100) == [text]
    assert split_text("", 4) == [""]


def test_an_extended_text_encodes_only_its_new_chunks(gguf_tok: HFTokenizer) -> None:
    rng = random.Random(1)
    words = [rng.choice(["alpha", "beta", "gamma", "delta", "it's", "42", "x\n"]) for _ in range(3000)]
    base = " ".join(words)
    enc = ChunkedEncoder(gguf_tok, chunk_chars=256, max_prefix_bytes=0)
    assert enc.encode(base) == gguf_tok.encode(base, add_special_tokens=False).ids
    pieces = len(split_text(base, 256))
    assert enc.misses == pieces and enc.hits == 0
    longer = base + " and five more new words"
    assert enc.encode(longer) == gguf_tok.encode(longer, add_special_tokens=False).ids
    assert enc.hits == pieces - 1 and enc.misses == pieces + 1     # only the last chunk again
    assert enc.encode(longer) == gguf_tok.encode(longer, add_special_tokens=False).ids
    assert enc.misses == pieces + 1                                 # all hits


def test_short_texts_are_not_cached(gguf_tok: HFTokenizer) -> None:
    enc = ChunkedEncoder(gguf_tok, chunk_chars=64)
    assert enc.encode("the cat sat on the mat") == gguf_tok.encode("the cat sat on the mat",
                                                                   add_special_tokens=False).ids
    assert enc.hits == enc.misses == enc.cached_tokens == 0


def test_the_cache_is_bounded(gguf_tok: HFTokenizer) -> None:
    enc = ChunkedEncoder(gguf_tok, chunk_chars=16, max_cached_tokens=50, max_prefix_bytes=0)
    rng = random.Random(2)
    for _ in range(20):
        text = " ".join(rng.choice(["one", "two", "three", "four"]) for _ in range(100))
        assert enc.encode(text) == gguf_tok.encode(text, add_special_tokens=False).ids
        assert enc.cached_tokens <= 50
        assert enc.cached_tokens == sum(map(len, enc.chunks._cache.values()))


@pytest.mark.parametrize("change, why", [
    (lambda t: setattr(t, "normalizer", normalizers.NFC()), "normalizer"),
    (lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.Metaspace()), "Metaspace"),
    (lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.ByteLevel(add_prefix_space=True)), "prefix space"),
    (lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)),
     "splits words"),
    (lambda t: setattr(t, "pre_tokenizer", split_then_bytes(r"\w+")), "unknown split regex"),
    (lambda t: setattr(t, "pre_tokenizer", None), "no pre-tokenizer"),
    (lambda t: t.add_tokens([AddedToken("new york", normalized=False)]), "added token"),
    (lambda t: t.add_special_tokens([AddedToken("<x>", rstrip=True)]), "added token"),
    (lambda t: t.enable_truncation(64), "truncates"),
])
def test_unsupported_tokenizers_encode_whole(gguf_tok: HFTokenizer, change, why: str) -> None:
    tok = HFTokenizer.from_str(gguf_tok.to_str())
    change(tok)
    reason = unchunkable_reason(tok)
    assert reason is not None and why in reason
    enc = ChunkedEncoder(tok, chunk_chars=8)
    text = "the cat sat on the mat " * 10
    assert enc.encode(text) == tok.encode(text, add_special_tokens=False).ids
    assert enc.encode_array(text).tolist() == tok.encode(text, add_special_tokens=False).ids
    assert enc.hits == enc.misses == enc.prefix_hits == 0 and enc.prefixes is None


def test_tokenizer_json_and_sentencepiece_backends() -> None:
    """The default model's loaded tokenizer chunks; its encode is the chunked one."""
    tok = load_tokenizer(default_gguf())
    assert tok._backend.encoder.enabled
    text = "Hello there. " * 500
    assert tok.encode(text) == tok._backend._tok.encode(text, add_special_tokens=False).ids
