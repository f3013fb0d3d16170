"""Chunked, cached encoding of long texts for ``tokenizers`` BPE tokenizers.

Tokenizing is the one step of a request that costs O(prompt) on every arrival, even when the
prompt's KV is all cached (tens of milliseconds for a prompt of tens of thousands of tokens). A prompt
usually extends one seen before (the next turn of a chat, a document asked another question), so
long texts are cut into chunks of about ``chunk_chars`` characters and each chunk's ids are cached
by its text: a text that extends an earlier one encodes only its last chunks. Chunks that miss the
cache are encoded together with ``encode_batch`` (in parallel on several cores).

The result is exactly ``encode(text)``: chunks are cut only in front of a single space between two
ASCII letters (``"word| word"``), a place where every pre-tokenizer accepted here splits the text
whatever surrounds it:

- the word-splitting regexes (GPT-2's, also ``ByteLevel(use_regex=True)``'s; Llama 3's; Qwen2's)
  cover every character; the match holding the letter before the cut consists of letters (after an
  optional leading character) or is a contraction, so it ends at the space; the match starting at
  the space is `` word`` in the whole text and in the chunk alone (no pattern looks behind, and the
  look-ahead ``\\s+(?!\\S)`` of a run before the cut reads a character before the cut);
- digit splits (``Split(\\p{N})``, ``Digits``) do not cut next to letters or spaces, and
  ``ByteLevel`` (without a prefix space) maps each character on its own;
- BPE encodes each pre-token on its own; added tokens are matched in the raw text before all of
  this, and none may contain a space or strip its neighbours, so none spans a cut.

Anything else (a normalizer, Metaspace, a BPE without a word-splitting pre-tokenizer, dropout,
truncation or padding, unknown regexes) is encoded whole. Chunk ends are the first cut at least
``chunk_chars`` past the previous end, so two texts sharing a prefix share every chunk that ends
(one character of look-ahead included) inside it.

``parts`` yields a text's ids a batch of chunks at a time, so a caller that only needs to know
whether a text exceeds some number of tokens stops after encoding about that many. The cache is
bounded by tokens and by bytes (chunk texts plus ids), and one text caches chunks only for its first
``max_cached_tokens // 4`` tokens: a huge prompt neither fills the cache nor evicts it.
``max_chars_per_token`` bounds how many characters one token spells, so a text longer than
``n * bound`` characters has more than ``n`` tokens without encoding any of it. Whole texts and
batches are encoded with ``encode_batch``, which releases the GIL.
"""

from __future__ import annotations

import json
import re
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterator

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

CHUNK_CHARS = 1024                # ~200 tokens of English text per chunk
MAX_CACHED_TOKENS = 1 << 19       # LRU bound on the ids held
MAX_CACHED_BYTES = 16 << 20       # LRU bound on the cache's memory: chunk texts plus ids (4 bytes each)
BATCH_CHUNKS = 32                 # chunks per encode_batch call (and per part) of a long text

_CUT = re.compile(r"(?<=[A-Za-z]) (?=[A-Za-z])")

# Split regexes known to cut at "word| word" (the spellings of tokenizer.json files and of
# radixrelay.text.tokenizer's GGUF pre-tokenizers).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_WORD_SPLITS = frozenset({_GPT2, _LLAMA3, _QWEN2})
_DIGIT_SPLITS = frozenset({r"\p{N}"})


def iter_pieces(text: str, chunk_chars: int = CHUNK_CHARS) -> Iterator[str]:
    """``text`` cut at the first cut point at least ``chunk_chars`` past the previous cut; the
    pieces concatenate to ``text``."""
    start = 0
    while True:
        m = _CUT.search(text, start + chunk_chars)
        if m is None:
            break
        yield text[start:m.start()]
        start = m.start()
    yield text[start:]


def split_text(text: str, chunk_chars: int = CHUNK_CHARS) -> list[str]:
    return list(iter_pieces(text, chunk_chars))


def unchunkable_reason(tok: HFTokenizer) -> str | None:
    """Why ``tok`` must encode texts whole (None: chunks at cut points encode exactly)."""
    if tok.normalizer is not None:
        return "it has a normalizer"
    if tok.truncation is not None or tok.padding is not None:
        return "it truncates or pads"
    model = tok.model
    if not isinstance(model, models.BPE) or model.dropout not in (None, 0.0):
        return "its model is not a deterministic BPE"
    for added in tok.get_added_tokens_decoder().values():
        if " " in added.content or added.lstrip or added.rstrip or added.single_word:
            return f"added token {added.content!r} may span or absorb a space"
    pre = tok.pre_tokenizer
    if pre is None:
        return "it has no pre-tokenizer"
    state = json.loads(pre.__getstate__())
    stages = state["pretokenizers"] if state.get("type") == "Sequence" else [state]
    splits_words = byte_level = False
    for stage in stages:
        kind = stage.get("type")
        if byte_level:
            return f"{kind} follows ByteLevel"
        if kind == "ByteLevel":
            if stage.get("add_prefix_space"):
                return "ByteLevel adds a prefix space"
            byte_level = True
            splits_words |= bool(stage.get("use_regex", True))
        elif kind == "Digits":
            pass
        elif kind == "Split":
            regex = (stage.get("pattern") or {}).get("Regex")
            if stage.get("behavior") != "Isolated" or stage.get("invert"):
                return "a Split is not isolated"
            if regex in _WORD_SPLITS:
                splits_words = True
            elif regex not in _DIGIT_SPLITS:
                return f"unknown split regex {regex!r}"
        else:
            return f"pre-tokenizer {kind} is not supported"
    return None if splits_words else "no pre-tokenizer splits words"


def max_chars_per_token(tok: HFTokenizer) -> int | None:
    """The most characters of text one token of ``tok`` spells, for the tokenizers that chunk
    (None for the others). Their pre-tokenizers drop no character and there is no normalizer, so
    each character of the text is in exactly one token; a token spells at most as many characters
    as its vocabulary string has (byte-level strings: one letter per byte, and a character is at
    least one byte), an added token its content. A fused unknown token spells any number: None."""
    if unchunkable_reason(tok) is not None or getattr(tok.model, "fuse_unk", False):
        return None
    return max(map(len, tok.get_vocab(with_added_tokens=True)), default=1)


class ChunkedEncoder:
    """``encode(text)`` == ``tok.encode(text, add_special_tokens=False).ids``, cheaper for long
    texts that share chunks with earlier ones. Safe to share between threads."""

    def __init__(self, tok: HFTokenizer, chunk_chars: int = CHUNK_CHARS,
                 max_cached_tokens: int = MAX_CACHED_TOKENS,
                 max_cached_bytes: int = MAX_CACHED_BYTES) -> None:
        self._tok = tok
        self.chunk_chars = chunk_chars
        self.max_cached_tokens = max_cached_tokens
        self.max_cached_bytes = max_cached_bytes
        self.reason = unchunkable_reason(tok)
        self.max_chars_per_token = max_chars_per_token(tok)
        self._cache: OrderedDict[str, array[int]] = OrderedDict()
        self._lock = threading.Lock()
        self.cached_tokens = 0
        self.cached_bytes = 0
        self.hits = 0                 # chunks served from the cache
        self.misses = 0               # chunks encoded

    @property
    def enabled(self) -> bool:
        return self.reason is None

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for ids in self.parts(text):
            out.extend(ids)
        return out

    def parts(self, text: str) -> Iterator[list[int]]:
        """``encode(text)`` in consecutive parts of at most ``BATCH_CHUNKS`` chunks each."""
        if len(text) < 2 * self.chunk_chars:
            yield self._tok.encode(text, add_special_tokens=False).ids
            return
        if self.reason is not None:
            yield self._tok.encode_batch([text], add_special_tokens=False)[0].ids
            return
        uncached = self.max_cached_tokens // 4     # this text's tokens not yet offered to the cache
        batch: list[str] = []
        for piece in iter_pieces(text, self.chunk_chars):
            batch.append(piece)
            if len(batch) == BATCH_CHUNKS:
                ids = self._encode_pieces(batch, cache=uncached > 0)
                uncached -= len(ids)
                yield ids
                batch = []
        if batch:
            yield self._encode_pieces(batch, cache=uncached > 0)

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()
            self.cached_tokens = self.cached_bytes = 0

    def _encode_pieces(self, pieces: list[str], cache: bool) -> list[int]:
        with self._lock:
            found = [self._get(p) for p in pieces]
        missing = list(dict.fromkeys(p for p, ids in zip(pieces, found) if ids is None))
        fresh: dict[str, list[int]] = {}
        if missing:
            encodings = self._tok.encode_batch(missing, add_special_tokens=False)
            fresh = {p: e.ids for p, e in zip(missing, encodings)}
            with self._lock:
                self.misses += len(missing)
                if cache:
                    for p, ids in fresh.items():
                        self._put(p, ids)
        out: list[int] = []
        for p, ids in zip(pieces, found):
            out.extend(fresh[p] if ids is None else ids)
        return out

    def _get(self, piece: str) -> array[int] | None:
        ids = self._cache.get(piece)
        if ids is not None:
            self._cache.move_to_end(piece)
            self.hits += 1
        return ids

    def _put(self, piece: str, ids: list[int]) -> None:
        size = sys.getsizeof(piece) + 4 * len(ids)
        if piece in self._cache or len(ids) > self.max_cached_tokens or size > self.max_cached_bytes:
            return
        self._cache[piece] = array("I", ids)
        self.cached_tokens += len(ids)
        self.cached_bytes += size
        while self._cache and (self.cached_tokens > self.max_cached_tokens
                               or self.cached_bytes > self.max_cached_bytes):
            old_piece, old = self._cache.popitem(last=False)
            self.cached_tokens -= len(old)
            self.cached_bytes -= sys.getsizeof(old_piece) + 4 * len(old)
