"""Chunked, cached encoding of long texts for ``tokenizers`` BPE tokenizers.

Tokenizing is the one step of a request that costs O(prompt) on every arrival, even when the
prompt's KV is all cached (tens of milliseconds for a prompt of tens of thousands of tokens). A prompt
usually extends one seen before (the next turn of a chat, a document asked another question), so a
long text is encoded in two steps:

- the longest prefix it shares with a recently encoded long text (``prefix_cache``: texts kept with
  their ids and the token offset at each of their chunk ends, and about every ``FINE_CHARS``
  characters over their last chunk, where the next question or turn usually departs) up to a cut
  point takes that text's ids as one slice of a packed array; finding it costs a few Python
  operations and C-level comparisons of the text, whatever its length;
- the rest, from that cut, is cut into chunks of about ``chunk_chars`` characters whose ids are
  cached by their text (``chunk_cache``); chunks that miss are encoded together with
  ``encode_batch`` (in parallel on several cores), each by one thread however many ask at once.

The result is exactly ``encode(text)``: texts are cut only in front of a single space between two
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
(one character of look-ahead included) inside it. A text sharing ``t[:c + 2]`` with a remembered
text that has a cut at ``c`` has that cut too, so its first ids are the remembered ones up to ``c``
and nothing is re-encoded around the seam to check it (``prefix_cache`` says more).

``encode_array`` gives the ids packed (``array('I')``, no Python int per id); ``encode`` builds the
list from it. ``parts`` yields a text's ids in parts (a remembered prefix's, then a batch of chunks
each), so a caller that only needs to know whether a text exceeds some number of tokens stops after
encoding about that many (a text is remembered only once all its parts were taken). The chunk cache
is bounded by tokens and by bytes (chunk texts plus ids), and one text caches chunks only for its
first ``max_cached_tokens // 4`` tokens; the remembered texts by bytes, one text at most a quarter:
a huge prompt neither fills the caches nor evicts them.
``max_chars_per_token`` bounds how many characters one token spells, so a text longer than
``n * bound`` characters has more than ``n`` tokens without encoding any of it. Whole texts and
batches are encoded with ``encode_batch``, which releases the GIL.
"""

from __future__ import annotations

import json
import re
import threading
from array import array
from collections.abc import Iterator
from itertools import islice

import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from radixrelay.text.chunk_cache import ChunkCache
from radixrelay.text.prefix_cache import PrefixCache

CHUNK_CHARS = 1024                # ~200 tokens of English text per chunk
MAX_CACHED_TOKENS = 1 << 19       # LRU bound on the ids held
MAX_CACHED_BYTES = 16 << 20       # LRU bound on the cache's memory: chunk texts plus ids (4 bytes each)
BATCH_CHUNKS = 32                 # chunks per encode_batch call (and per part) of a long text
MAX_PREFIX_BYTES = 64 << 20       # LRU bound on the remembered texts: texts, ids, lists, cut points
FINE_CHARS = 64                   # cut points this far apart over a remembered text's last chunk
PREFIX_NEW_CHUNKS = 8             # a text sharing a remembered prefix is remembered too when it has
                                  # this many chunks' characters past the reusable cut (or extends it)

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


def iter_pieces(text: str, chunk_chars: int = CHUNK_CHARS, start: int = 0) -> Iterator[str]:
    """``text[start:]`` cut at the first cut point at least ``chunk_chars`` past the previous cut
    (``start`` the first); the pieces concatenate to ``text[start:]``."""
    while True:
        m = _CUT.search(text, start + chunk_chars)
        if m is None:
            break
        yield text[start:m.start()]
        start = m.start()
    yield text[start:]


def _batches(items: Iterator[str], n: int) -> Iterator[tuple[list[str], bool]]:
    """Lists of ``n`` items (the last one shorter), each with whether it is the last."""
    batch = list(islice(items, n))
    while batch:
        after = list(islice(items, n))
        yield batch, not after
        batch = after


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
    texts that share a prefix or chunks with earlier ones. Safe to share between threads.
    ``max_prefix_bytes=0``: no reuse by prefix (chunks only, as before prefixes were remembered)."""

    def __init__(self, tok: HFTokenizer, chunk_chars: int = CHUNK_CHARS,
                 max_cached_tokens: int = MAX_CACHED_TOKENS,
                 max_cached_bytes: int = MAX_CACHED_BYTES,
                 max_prefix_bytes: int = MAX_PREFIX_BYTES) -> None:
        self._tok = tok
        self.chunk_chars = chunk_chars
        self.reason = unchunkable_reason(tok)
        self.max_chars_per_token = max_chars_per_token(tok)
        self.chunks = ChunkCache(tok, max_cached_tokens, max_cached_bytes)
        self.prefixes = (PrefixCache(max_prefix_bytes, chunk_chars, PREFIX_NEW_CHUNKS * chunk_chars)
                         if max_prefix_bytes > 0 and self.reason is None else None)
        self._ints: np.ndarray | None = None            # [vocabulary] int objects, for _to_list
        self._lock = threading.Lock()
        self._tokens_encoded = 0      # by whole texts and tails (the chunks' are the chunk cache's)

    # Bounds and counters.
    enabled = property(lambda self: self.reason is None)
    max_cached_tokens = property(lambda self: self.chunks.max_tokens)
    max_cached_bytes = property(lambda self: self.chunks.max_bytes)
    cached_tokens = property(lambda self: self.chunks.tokens)
    cached_bytes = property(lambda self: self.chunks.bytes)
    hits = property(lambda self: self.chunks.hits, doc="chunks served from the cache")
    misses = property(lambda self: self.chunks.misses, doc="chunks encoded")
    shared = property(lambda self: self.chunks.shared, doc="chunks waited for (another thread encoding)")
    max_prefix_bytes = property(lambda self: self.prefixes.max_bytes if self.prefixes else 0)
    prefix_bytes = property(lambda self: self.prefixes.bytes if self.prefixes else 0)
    prefix_texts = property(lambda self: len(self.prefixes) if self.prefixes else 0)
    prefix_hits = property(lambda self: self.prefixes.hits if self.prefixes else 0,
                           doc="texts that took a remembered text's ids for their prefix")
    prefix_tokens_reused = property(lambda self: self.prefixes.tokens_reused if self.prefixes else 0)
    tokens_encoded = property(lambda self: self._tokens_encoded + self.chunks.tokens_encoded,
                              doc="ids the tokenizer produced for this encoder")

    def encode(self, text: str) -> list[int]:
        if len(text) < 2 * self.chunk_chars or self.reason is not None:
            return self._whole(text)
        parts = self._arrays(text, listed=True)
        out = next(parts)
        out = out if isinstance(out, list) else out.tolist()
        for part in parts:
            out.extend(part)
        return out

    def encode_array(self, text: str) -> array[int]:
        """``encode(text)`` packed (``array('I')``, the caller's own; ``numpy.frombuffer(ids,
        numpy.uint32)`` views it): a text whose prefix is remembered costs no Python int per id."""
        if len(text) < 2 * self.chunk_chars or self.reason is not None:
            return array("I", self._whole(text))
        parts = self._arrays(text)
        out = next(parts)
        for part in parts:
            out.extend(part)
        return out

    def parts(self, text: str) -> Iterator[list[int]]:
        """``encode(text)`` in consecutive parts: a remembered prefix's ids, then the rest at most
        ``BATCH_CHUNKS`` chunks a part."""
        if len(text) < 2 * self.chunk_chars or self.reason is not None:
            yield self._whole(text)
            return
        for part in self._arrays(text, listed=True):
            yield part if isinstance(part, list) else part.tolist()

    def clear(self) -> None:
        self.chunks.clear()
        if self.prefixes is not None:
            self.prefixes.clear()

    def _to_list(self, ids: array[int]) -> list[int]:
        """``ids.tolist()`` made of one shared int object per id of the vocabulary."""
        if self._ints is None:
            self._ints = np.arange(self._tok.get_vocab_size(with_added_tokens=True), dtype=np.int64).astype(object)
        packed = np.frombuffer(ids, dtype=np.uint32)
        if packed.size and packed.max() >= len(self._ints):
            return ids.tolist()
        return self._ints[packed].tolist()

    def _whole(self, text: str) -> list[int]:
        if len(text) < 2 * self.chunk_chars:
            ids = self._tok.encode(text, add_special_tokens=False).ids
        else:
            ids = self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        with self._lock:
            self._tokens_encoded += len(ids)
        return ids

    def _arrays(self, text: str, listed: bool = False) -> Iterator[array[int] | list[int]]:
        """A long text's ids in parts the caller owns: the longest remembered prefix's (a list when
        ``listed``), then the rest from that cut (chunked when long) in arrays; the text is
        remembered once all parts were taken."""
        prefixes = self.prefixes
        reuse = None if prefixes is None else prefixes.find(text)
        keep = prefixes is not None and prefixes.worth_keeping(text, reuse)
        ids, cuts, offsets = array("I"), array("I"), array("I")      # the text's, if kept
        start = total = 0
        if reuse is not None:
            entry, start, total = reuse.entry, reuse.pos, reuse.offset
            head = prefixes.listed(entry, self._to_list)[:total] if listed else entry.ids[:total]
            if start == len(text):
                yield head
                return
            if keep:
                ids = entry.ids[:total]
                cuts, offsets = entry.cuts[:reuse.ncuts], entry.offsets[:reuse.ncuts]
                if not cuts or cuts[-1] != start:
                    cuts.append(start)
                    offsets.append(total)
            yield head
        if not keep and len(text) - start < 2 * self.chunk_chars:
            part = array("I", self._tok.encode(text[start:], add_special_tokens=False).ids)
            with self._lock:
                self._tokens_encoded += len(part)
            yield part
        else:
            # Chunks from the cut; a kept text's last chunk in pieces of FINE_CHARS (each a cut
            # point), so that texts diverging near its end re-encode little.
            uncached = self.chunks.max_tokens // 4      # this text's tokens not yet offered to the cache
            pos = start
            pieces = (iter_pieces(text, self.chunk_chars, start) if len(text) - start >= 2 * self.chunk_chars
                      else iter((text[start:],)))
            for batch, last in _batches(pieces, BATCH_CHUNKS):
                fine: list[str] = []
                if keep and last:
                    fine = list(iter_pieces(text, FINE_CHARS, pos + sum(map(len, batch[:-1]))))
                    batch.pop()
                got = self.chunks.ids(batch, cache=uncached > 0) if batch else []
                if fine:
                    got += self.chunks.ids(fine, cache=False)
                part = array("I")
                for piece, piece_ids in zip(batch + fine, got):
                    if keep and pos and (not cuts or cuts[-1] != pos):
                        cuts.append(pos)
                        offsets.append(total)
                    part.extend(piece_ids)
                    pos += len(piece)
                    total += len(piece_ids)
                uncached -= len(part)
                if keep:
                    ids.extend(part)
                yield part
        if keep:
            as_list = None                               # list callers: the kept text's list too
            if listed:
                before = None if reuse is None else reuse.entry.listed
                if before is None:
                    as_list = self._to_list(ids)
                else:
                    as_list = before[:reuse.offset]
                    as_list += self._to_list(ids[reuse.offset:])
            prefixes.remember(text, ids, cuts, offsets, as_list)
