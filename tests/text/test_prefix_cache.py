"""Reuse by prefix (``radixrelay.text.prefix_cache`` through ``ChunkedEncoder``) and the chunk cache's
single flight (``radixrelay.text.chunk_cache``): the ids are exactly those of one encode of the whole
text whatever was remembered, whoever encodes at the same time."""

from __future__ import annotations

import random
import threading
import time
from array import array

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import pre_tokenizers

from radixrelay.text.encode_cache import _CUT, _LLAMA3, ChunkedEncoder, split_text
from radixrelay.text.prefix_cache import MAX_PER_KEY
from radixrelay.text.tokenizer import load_tokenizer
from tests.text.test_encode_cache import PARTS, split_then_bytes, with_pre
from tests.text.test_tokenizer import default_gguf

WORDS = [" the", " cat", " sat", " on", " a", " mat", " Zebra", " b", " it's", " we"]
# Characters and their look-alikes sharing the first UTF-8 byte (a divergence inside a character's bytes).
END_SUFFIXES = [" word", "word", "'s", "1", " 1", "  two", " \nnext", "<|im_end|>", "é", ".", " "]
SIBLINGS = {"é": "è", "中": "丰", "😀": "😁", "Ω": "Ψ", "ï": "î", "a": "b", " ": "\n"}


@pytest.fixture(scope="module")
def gguf_tok() -> HFTokenizer:
    return load_tokenizer(default_gguf())._backend._tok


def ref(tok: HFTokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def text_of(rng: random.Random, n: int) -> str:
    """Words with single spaces (cut points) among the awkward parts of test_encode_cache."""
    return "".join(rng.choice(WORDS) if rng.random() < 0.6 else rng.choice(PARTS) for _ in range(n))


def variants(rng: random.Random, base: str) -> list[str]:
    """Texts that extend ``base``, are its prefixes, or diverge from it just before, at and after its
    cut points, inside a character's bytes, inside special tokens."""
    cuts = [m.start() for m in _CUT.finditer(base)] or [len(base) // 2]
    out = [base, base + text_of(rng, 8), base + " word", base + "word", base + "\n\n<|im_end|>"]
    for c in rng.sample(cuts, min(6, len(cuts))):
        for k in (c - 1, c, c + 1, c + 2, c + 3):
            k = max(0, min(k, len(base)))
            out += [base[:k], base[:k] + text_of(rng, 6), base[:k] + "Q" + base[k:]]
    for ch, sibling in SIBLINGS.items():
        k = base.find(ch, rng.randrange(len(base)))
        if k > 0:
            out.append(base[:k] + sibling + base[k + 1:])
    k = base.find("<|im_start|>")
    if k > 0:                                      # diverge inside a special token
        out += [base[:k + 5] + " tail words", base[:k] + "<|im_end|>" + base[k + 12:]]
    for _ in range(4):
        k = rng.randrange(len(base))
        out.append(base[:k] + text_of(rng, rng.randrange(1, 30)))
    return out


@pytest.mark.parametrize("pre", ["smollm (gguf)", "llama3", "digits + bytelevel"])
def test_reuse_by_prefix_is_exact(gguf_tok: HFTokenizer, pre: str) -> None:
    tok = {"smollm (gguf)": lambda: gguf_tok,
           "llama3": lambda: with_pre(gguf_tok, split_then_bytes(_LLAMA3)),
           "digits + bytelevel": lambda: with_pre(gguf_tok, pre_tokenizers.Sequence(
               [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])),
           }[pre]()
    enc = ChunkedEncoder(tok, chunk_chars=16, max_cached_tokens=4000, max_prefix_bytes=1 << 20)
    rng = random.Random(pre)
    for _ in range(12):
        base = text_of(rng, rng.randrange(20, 200))
        for text in variants(rng, base):
            want = ref(tok, text)
            assert enc.encode(text) == want, repr(text)
            assert enc.encode_array(text).tolist() == want, repr(text)
            assert [i for part in enc.parts(text) for i in part] == want, repr(text)
        for suffix in END_SUFFIXES:                # past the end of the remembered text itself
            enc.prefixes.clear()
            enc.encode(base)
            assert enc.encode(base + suffix) == ref(tok, base + suffix), repr(base + suffix)
    assert enc.prefix_hits > 100 and enc.prefix_tokens_reused > 1000
    assert 0 < enc.prefix_bytes <= enc.max_prefix_bytes


def test_a_remembered_text_encodes_only_its_tail(gguf_tok: HFTokenizer) -> None:
    rng = random.Random(3)
    doc = "".join(rng.choice(WORDS) for _ in range(20000))
    enc = ChunkedEncoder(gguf_tok)
    want = ref(gguf_tok, doc)
    assert enc.encode(doc) == want
    encoded = enc.tokens_encoded
    assert encoded == len(want) and enc.prefix_texts == 1 and enc.prefix_hits == 0
    got = enc.encode_array(doc)
    assert isinstance(got, array) and got.typecode == "I" and got.tolist() == want
    assert enc.tokens_encoded == encoded and enc.prefix_tokens_reused == len(want)
    got[0] = 7                                     # the caller's own: the cache is unchanged
    listed = enc.encode(doc)                       # a list: made once from the entry's ids, then sliced
    assert listed == want and enc.prefixes.find(doc).entry.listed == want
    listed[0] = 7
    assert enc.encode(doc) == want and enc.encode_array(doc).tolist() == want
    assert enc.prefix_bytes == sum(e.nbytes for e in enc.prefixes._lru)
    for question in ["\n\nWhat is the cat?", " and the mat", "Z?"]:     # after a cut, at the end, in a word
        text = doc + question
        before = enc.tokens_encoded
        assert enc.encode(text) == ref(gguf_tok, text)
        assert enc.tokens_encoded - before < 2 * enc.chunk_chars // 2      # < 2 chunks' tokens
    assert enc.prefix_texts == 1


def test_what_is_remembered(gguf_tok: HFTokenizer) -> None:
    rng = random.Random(4)
    doc = "".join(rng.choice(WORDS) for _ in range(3000))
    enc = ChunkedEncoder(gguf_tok, chunk_chars=64)
    first = doc + " Question one?"
    enc.encode(first)
    assert enc.prefix_texts == 1
    enc.encode(doc + " Question two?")               # shares the document, little new: not kept
    assert enc.prefix_texts == 1 and enc.prefix_hits == 1
    longer = first + " Answer." + "".join(rng.choice(WORDS) for _ in range(5))
    enc.encode(longer)                              # extends it: replaces it
    assert enc.prefix_texts == 1
    assert enc.prefixes.find(longer).entry.text == longer
    other = doc[:len(doc) // 2] + "".join(rng.choice(WORDS) for _ in range(2000))
    enc.encode(other)                               # many chunks past the shared cut: kept too
    assert enc.prefix_texts == 2
    assert enc.encode(doc + " Question two?") == ref(gguf_tok, doc + " Question two?")
    # Entries sharing their first chunk_chars characters: at most MAX_PER_KEY.
    for k in range(MAX_PER_KEY + 3):
        enc.encode(doc[:200] + f" variant{k} " + "".join(rng.choice(WORDS) for _ in range(2000)))
    assert enc.prefix_texts == MAX_PER_KEY


def test_remembered_texts_are_bounded_by_bytes(gguf_tok: HFTokenizer) -> None:
    rng = random.Random(5)
    docs = ["".join(rng.choice(WORDS) for _ in range(1500)) + f" doc{k}" for k in range(12)]
    enc = ChunkedEncoder(gguf_tok, chunk_chars=64, max_prefix_bytes=120_000)
    for doc in docs:
        assert enc.encode(doc) == ref(gguf_tok, doc)
        entries = enc.prefixes._lru
        assert enc.prefix_bytes == sum(e.nbytes for e in entries) <= 120_000
    assert 1 < enc.prefix_texts < len(docs)
    hits = enc.prefix_hits
    enc.encode(docs[0])                             # least recently used: gone
    assert enc.prefix_hits == hits
    enc.encode(docs[-1])
    assert enc.prefix_hits == hits + 1
    huge = "".join(rng.choice(WORDS) for _ in range(12000))     # over a quarter of the bound: not kept
    assert enc.encode(huge) == ref(gguf_tok, huge)
    assert all(e.text != huge for e in enc.prefixes._lru)
    enc.clear()
    assert enc.prefix_bytes == enc.prefix_texts == enc.cached_bytes == 0


class SlowCounting:
    """A tokenizer that records what it encodes in batches and takes ``delay`` seconds a batch (so
    that threads overlap); ``fail_first``: the first batch raises."""

    def __init__(self, tok: HFTokenizer, delay: float, fail_first: bool = False) -> None:
        self._tok, self.delay, self.fail = tok, delay, fail_first
        self.batches: list[list[str]] = []
        self._lock = threading.Lock()

    def __getattr__(self, name: str):
        return getattr(self._tok, name)

    def encode_batch(self, texts, **kw):
        with self._lock:
            self.batches.append(list(texts))
            fail, self.fail = self.fail, False
        time.sleep(self.delay)
        if fail:
            raise RuntimeError("encode failed")
        return self._tok.encode_batch(texts, **kw)


def run_threads(n: int, fn) -> list:
    out: list = [None] * n
    barrier = threading.Barrier(n)

    def work(i: int) -> None:
        barrier.wait()
        out[i] = fn(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_concurrent_misses_encode_each_chunk_once(gguf_tok: HFTokenizer) -> None:
    rng = random.Random(6)
    doc = "".join(rng.choice(WORDS) for _ in range(4000))
    slow = SlowCounting(gguf_tok, delay=0.02)
    enc = ChunkedEncoder(slow, chunk_chars=64)
    texts = [doc + f" question {i}?" for i in range(4)] + [doc] * 4     # the same text, and 4 sharing it
    got = run_threads(len(texts), lambda i: enc.encode(texts[i]))
    for text, ids in zip(texts, got):
        assert ids == ref(gguf_tok, text)
    encoded = [p for batch in slow.batches for p in batch]
    assert len(encoded) == len(set(encoded)) == enc.misses          # no piece encoded twice
    assert enc.misses <= len(split_text(doc + " question 0?", 64)) + len(texts)
    assert enc.shared > 0


def test_a_failed_encode_leaves_its_waiters_to_encode(gguf_tok: HFTokenizer) -> None:
    rng = random.Random(7)
    doc = "".join(rng.choice(WORDS) for _ in range(1000))
    slow = SlowCounting(gguf_tok, delay=0.05, fail_first=True)
    enc = ChunkedEncoder(slow, chunk_chars=64)
    got = run_threads(3, lambda i: _or_error(lambda: enc.encode(doc)))
    assert sum(isinstance(g, RuntimeError) for g in got) == 1
    assert all(g == ref(gguf_tok, doc) for g in got if not isinstance(g, RuntimeError))
    assert not enc.chunks._flights and enc.encode(doc) == ref(gguf_tok, doc)


def _or_error(fn):
    try:
        return fn()
    except RuntimeError as exc:
        return exc


def test_threads_share_the_caches(gguf_tok: HFTokenizer) -> None:
    rng = random.Random(8)
    docs = ["".join(rng.choice(WORDS) for _ in range(1500)) for _ in range(3)]
    enc = ChunkedEncoder(gguf_tok, chunk_chars=64, max_prefix_bytes=200_000)
    work = [[docs[(i + k) % 3][:rng.randrange(1, 8000)] + text_of(rng, 10) for k in range(12)] for i in range(6)]
    got = run_threads(6, lambda i: [enc.encode(t) for t in work[i]])
    for texts, ids in zip(work, got):
        assert ids == [ref(gguf_tok, t) for t in texts]
    assert enc.prefix_hits


def test_the_tokenizer_reuses_prefixes() -> None:
    """The loaded default tokenizer: plain encode, ``max_tokens`` and ``encode_ends`` over parts."""
    tok = load_tokenizer(default_gguf())
    hf = tok._backend._tok
    rng = random.Random(9)
    doc = "".join(rng.choice(WORDS) for _ in range(6000))
    text = doc + " and a question?"
    whole = ref(hf, text)
    assert tok.encode(doc, add_special_tokens=False) == ref(hf, doc)
    assert tok.encode(text, add_special_tokens=False, max_tokens=len(whole)) == whole
    ends = tok.encode_ends(text, add_special_tokens=False, head=10, tail=100)
    assert len(ends) == len(whole) and ends[:10] == whole[:10] and ends[len(whole) - 100:] == whole[-100:]
    assert tok._backend.encoder.prefix_hits >= 2


def test_conversations_under_one_system_prompt(gguf_tok: HFTokenizer) -> None:
    """Texts sharing their first characters (one key): each takes the ids of the one it shares most
    with, whatever order they were remembered in."""
    rng = random.Random(10)
    system = "".join(rng.choice(WORDS) for _ in range(40))
    convs = [system + f" user{k}" + "".join(rng.choice(WORDS) for _ in range(600)) for k in range(12)]
    enc = ChunkedEncoder(gguf_tok, chunk_chars=64)
    for conv in convs:
        enc.encode(conv)
    assert enc.prefix_texts == len(convs)
    for k in rng.sample(range(len(convs)), len(convs)):
        reused, before = enc.prefix_tokens_reused, enc.tokens_encoded
        text = convs[k][:len(convs[k]) - rng.randrange(0, 200)] + " and then?"
        want = ref(gguf_tok, text)
        assert enc.encode(text) == want
        assert enc.prefix_tokens_reused - reused > len(want) - 80         # its own conversation's
        assert enc.tokens_encoded - before < 80
    # A text sharing more with an older entry than with newer ones takes the older one's.
    half = convs[0][:len(convs[0]) // 2] + "".join(rng.choice(WORDS) for _ in range(200))
    enc.encode(half)
    assert enc.prefixes.find(convs[0] + " more").entry.text == convs[0]
