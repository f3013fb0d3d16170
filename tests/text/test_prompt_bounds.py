"""Bounded encoding of prompts (``Tokenizer.encode(max_tokens=...)``, ``Tokenizer.encode_ends``):
the ids are exactly those of a full encode, a text over the bound is refused after encoding about
the bound's worth of it (or none of it, past the character bound), and truncating the kept ends
serves what truncating the full encoding does."""

from __future__ import annotations

import random

import pytest

from radixrelay.radix.truncation import Truncation
from radixrelay.text.encode_cache import BATCH_CHUNKS, ChunkedEncoder, max_chars_per_token
from radixrelay.text.tokenizer import TokenEnds, TooManyTokens, load_tokenizer
from tests.text.test_encode_cache import PARTS, random_text
from tests.text.test_tokenizer import default_gguf


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(default_gguf())


def words(rng: random.Random, n: int) -> str:
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
             for _ in range(2000)]
    return " ".join(rng.choice(vocab) for _ in range(n))


def test_no_token_spells_more_than_the_bound(tok) -> None:
    hf = tok._backend._tok
    bound = max_chars_per_token(hf)
    assert bound is not None and bound == tok._backend.max_chars_per_token
    for token_id in range(hf.get_vocab_size(with_added_tokens=True)):
        assert len(hf.decode([token_id], skip_special_tokens=False)) <= bound
    rng = random.Random(0)
    for _ in range(200):
        text = random_text(rng, rng.randrange(1, 300))
        assert len(text) <= bound * len(tok.encode(text, add_special_tokens=False))


def test_bounded_encode_is_exact_up_to_the_bound(tok) -> None:
    rng = random.Random(1)
    texts = [random_text(rng, rng.randrange(1, 400)) for _ in range(40)]
    texts += [words(rng, rng.randrange(500, 3000)) for _ in range(6)]
    for text in texts:
        for special in (True, False):
            full = tok.encode(text, special)
            n = len(full)
            assert tok.encode(text, special, max_tokens=n) == full
            assert tok.encode(text, special, max_tokens=n + 1) == full
            with pytest.raises(TooManyTokens):
                tok.encode(text, special, max_tokens=n - 1)


def test_a_long_text_is_refused_after_encoding_about_the_bound(tok) -> None:
    enc: ChunkedEncoder = tok._backend.encoder
    text = words(random.Random(2), 200_000)             # ~1.3 MB: ~1300 chunks, ~350K tokens
    assert len(text) < 20_000 * enc.max_chars_per_token   # under the character bound
    misses = enc.misses
    with pytest.raises(TooManyTokens) as err:
        tok.encode(text, max_tokens=20_000)
    assert err.value.limit == 20_000
    # 20K tokens are ~100 chunks: encoded a batch at a time, not the ~1300 of the whole text.
    assert enc.misses - misses <= 100 + BATCH_CHUNKS
    # Past the character bound nothing is encoded at all.
    huge = "x" * (1000 * enc.max_chars_per_token + 1)
    misses, hits = enc.misses, enc.hits
    with pytest.raises(TooManyTokens):
        tok.encode(huge, add_special_tokens=False, max_tokens=1000)
    assert (enc.misses, enc.hits) == (misses, hits)


def test_one_text_caches_a_bounded_share(tok) -> None:
    base = tok._backend._tok
    enc = ChunkedEncoder(base, max_cached_tokens=8000, max_cached_bytes=1 << 30)
    text = words(random.Random(3), 60_000)
    assert enc.encode(text) == base.encode(text, add_special_tokens=False).ids
    # Offered to the cache: parts until 2000 (8000 // 4) tokens were offered, at most one batch more.
    assert 2000 <= enc.cached_tokens <= 2000 + BATCH_CHUNKS * 400
    assert enc.cached_tokens < 8000


def test_the_cache_is_bounded_by_bytes(tok) -> None:
    base = tok._backend._tok
    enc = ChunkedEncoder(base, chunk_chars=64, max_cached_bytes=20_000)
    rng = random.Random(4)
    for _ in range(10):
        text = words(rng, 2000)
        assert enc.encode(text) == base.encode(text, add_special_tokens=False).ids
        assert 0 < enc.cached_bytes <= 20_000
        assert enc.cached_tokens == sum(map(len, enc.chunks._cache.values()))
    enc.clear()
    assert enc.cached_bytes == enc.cached_tokens == 0 and not enc.chunks._cache


def test_token_ends(tok) -> None:
    text = words(random.Random(5), 30_000)
    full = tok.encode(text)
    ends = tok.encode_ends(text, head=16, tail=1000)
    assert isinstance(ends, TokenEnds) and len(ends) == len(full)
    assert ends[:16] == full[:16] and ends[len(full) - 1000:] == full[-1000:]
    assert ends[-1] == full[-1] and ends[3] == full[3] and ends[len(full) - 5:len(full) - 2] == full[-5:-2]
    with pytest.raises(IndexError):
        ends[10:20]
    with pytest.raises(IndexError):
        ends[100]
    short = tok.encode_ends("a few words", head=4, tail=4)
    assert short == tok.encode("a few words") and isinstance(short, list)


@pytest.mark.parametrize("context, ratio, page_size", [(256, 0.5, 16), (1000, 0.25, 1), (8192, 0.1, 64)])
def test_truncating_the_ends_serves_what_truncating_everything_does(tok, context, ratio, page_size) -> None:
    t = Truncation(ratio, context, page_size)
    rng = random.Random(context)
    for n in (context // 3, context * 2, context * 7):
        text = words(rng, n)
        full = tok.encode(text)
        ends = tok.encode_ends(text, head=t.head, tail=context + t.chunk)
        for want in (1, 16, context // 2):
            if len(full) + want <= context:
                assert list(ends) == full
                continue
            try:
                expected = t.apply(full, want)
            except ValueError:
                with pytest.raises(ValueError):
                    t.apply(ends, want)
                continue
            got = t.apply(ends, want)
            assert (got.ids, got.dropped, got.shifted_prefix, got.shifted_at) == \
                (expected.ids, expected.dropped, expected.shifted_prefix, expected.shifted_at)


def test_parts_concatenate_to_the_encoding(tok) -> None:
    enc: ChunkedEncoder = tok._backend.encoder
    rng = random.Random(6)
    for text in (words(rng, 40_000), "".join(rng.choice(PARTS) for _ in range(20_000)), "short"):
        parts = list(enc.parts(text))
        assert [t for p in parts for t in p] == tok._backend._tok.encode(text, add_special_tokens=False).ids


def test_encode_array_is_encode_packed(tok) -> None:
    """int32 ids equal to ``encode``'s, BOS as ``encode`` puts it, the bound refused as ``encode`` refuses it;
    a text whose prefix the encode cache remembers gives the same ids again."""
    import copy

    import numpy as np

    rng = random.Random(3)
    with_bos = copy.copy(tok)
    with_bos.add_bos_token, with_bos.bos_token_id = True, 1
    texts = [random_text(rng, rng.randrange(1, 300)) for _ in range(10)] + [words(rng, 3000), ""]
    for t in (tok, with_bos):
        for text in texts:
            for special in (True, False):
                full = t.encode(text, special)
                for _ in range(2):                          # the second: a remembered text
                    got = t.encode_array(text, special)
                    assert got.dtype == np.int32 and got.tolist() == full
                n = len(full)
                if n:
                    assert t.encode_array(text, special, max_tokens=n).tolist() == full
                    with pytest.raises(TooManyTokens):
                        t.encode_array(text, special, max_tokens=n - 1)
    long = words(rng, 20_000)                               # far past 4 characters per allowed token
    enc: ChunkedEncoder = tok._backend.encoder
    misses = enc.misses
    with pytest.raises(TooManyTokens):
        tok.encode_array(long, max_tokens=1000)
    assert enc.misses - misses <= 10 + BATCH_CHUNKS           # in parts, stopped soon after the bound
