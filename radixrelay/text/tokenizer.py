"""Tokenizer loading: Hugging Face directories and GGUF files behind one ``Tokenizer`` class.

Sources, by what ``load_tokenizer`` is given:
- a directory with ``tokenizer.json``: the ``tokenizers`` library;
- a directory with ``tokenizer.model`` only: sentencepiece;
- a directory with neither but exactly one ``.gguf`` file (a packaged model): that file;
- a ``.gguf`` file: a ``tokenizers`` object rebuilt from the file's ``tokenizer.*`` metadata
  (``gpt2`` = byte-level BPE, ``llama`` = sentencepiece-style BPE with byte fallback).

Conventions every backend follows: ``encode`` recognises special-token strings in the text
(``<|im_start|>`` becomes one id) and adds nothing; the ``Tokenizer`` alone decides whether to
prepend BOS. ``decode`` applies no clean-up of tokenization spaces. ``tokenizers`` backends encode
long texts in chunks and cache the chunks' ids (``encode_cache``: same ids, and a prompt that extends
an earlier one costs only its new part).

Prompts may be far longer than any context. ``encode(text, max_tokens=n)`` raises ``TooManyTokens``
once the text is known to have more than ``n`` tokens: at once when it has more characters than
``n`` tokens can spell, else after encoding about ``n`` tokens (backends that chunk; the others
encode the whole text). ``encode_ends`` counts a text's tokens but keeps only its first and last
ones (what left truncation serves), in memory bounded by what it keeps.

``encode_array`` is ``encode`` as an int32 numpy array, what frontends send to the scheduler packed:
with a ``tokenizers`` backend a text whose prefix the encode cache remembers never becomes a Python
int per id (a slice of the remembered ids, the tail encoded, one copy).
"""

from __future__ import annotations

import json
import logging
import re
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, overload

import numpy as np
import sentencepiece
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from radixrelay.gguf_file import read_metadata
from radixrelay.text.encode_cache import ChunkedEncoder

logger = logging.getLogger(__name__)
# encode_array with a bound: texts up to this many characters per allowed token are encoded whole (English
# runs ~4-5 characters a token), longer ones in parts that stop once the bound is passed.
ARRAY_CHARS_PER_TOKEN = 4


class TooManyTokens(ValueError):
    """A text encodes to more than ``limit`` tokens."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the text has more than {limit} tokens")
        self.limit = limit


class TokenEnds(Sequence[int]):
    """The ids of an encoding with its middle left out: ``len`` is the whole encoding's; indexes
    and contiguous slices within the first ``len(first)`` or the last ``len(last)`` ids work,
    others raise ``IndexError``."""

    def __init__(self, first: list[int], last: list[int], count: int) -> None:
        assert len(first) + len(last) <= count
        self.first, self.last, self.count = first, last, count

    def __len__(self) -> int:
        return self.count

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        lo = self.count - len(self.last)          # index of last[0]
        if isinstance(index, slice):
            start, stop, step = index.indices(self.count)
            stop = max(start, stop)
            if step == 1 and stop <= len(self.first):
                return self.first[start:stop]
            if step == 1 and start >= lo:
                return self.last[start - lo:stop - lo]
        else:
            i = index + self.count if index < 0 else index
            if 0 <= i < len(self.first):
                return self.first[i]
            if lo <= i < self.count:
                return self.last[i - lo]
        raise IndexError(f"ids {index} of {self.count} were not kept")


class TokenizerBackend(Protocol):
    vocab_size: int
    max_chars_per_token: int | None   # no token spells more characters (None: not known)

    def encode(self, text: str) -> list[int]: ...
    def encode_array(self, text: str) -> array[int]: ...     # encode(text) packed: array('I'), the caller's
    def parts(self, text: str) -> Iterator[list[int]]: ...   # encode(text) in consecutive parts
    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str: ...
    def id_to_token(self, token_id: int) -> str | None: ...
    def token_to_id(self, token: str) -> int | None: ...
    def special_ids(self) -> frozenset[int]: ...
    def builtin_bos_eos(self) -> tuple[int | None, int | None]: ...
    def adds_bos_by_default(self, bos: int) -> bool: ...


class HFBackend:
    """A ``tokenizers.Tokenizer``; special tokens are its added tokens marked special."""

    def __init__(self, tokenizer: HFTokenizer) -> None:
        self._tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.encoder = ChunkedEncoder(tokenizer)   # long texts: remembered prefixes, then cached chunks
        self.max_chars_per_token = self.encoder.max_chars_per_token

    def encode(self, text: str) -> list[int]:
        return self.encoder.encode(text)

    def encode_array(self, text: str) -> array[int]:
        return self.encoder.encode_array(text)

    def parts(self, text: str) -> Iterator[list[int]]:
        return self.encoder.parts(text)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def special_ids(self) -> frozenset[int]:
        added = self._tok.get_added_tokens_decoder()
        return frozenset(i for i, tok in added.items() if tok.special)

    def builtin_bos_eos(self) -> tuple[int | None, int | None]:
        return None, None  # tokenizer.json names no bos/eos; tokenizer_config does

    def adds_bos_by_default(self, bos: int) -> bool:
        """tokenizer.json files (Llama 3 and others) add BOS through their post-processor."""
        probe = self._tok.encode("a", add_special_tokens=True).ids
        return bool(probe) and probe[0] == bos


class SentencePieceBackend:
    """A sentencepiece model. Control pieces (``<s>``, ``</s>``, ...) written in the text are
    matched whole, as Hugging Face does; sentencepiece itself would spell them out."""

    def __init__(self, processor: sentencepiece.SentencePieceProcessor) -> None:
        self._sp = processor
        self.vocab_size = processor.get_piece_size()
        self._special = frozenset(
            i for i in range(self.vocab_size) if processor.is_control(i) or processor.is_unknown(i)
        )
        named = sorted(
            (processor.id_to_piece(i) for i in self._special if processor.is_control(i)),
            key=len,
            reverse=True,
        )
        self._split = re.compile("(" + "|".join(map(re.escape, named)) + ")") if named else None
        # Its normalizer may shorten a text (runs of spaces become one): no bound.
        self.max_chars_per_token = None

    def parts(self, text: str) -> Iterator[list[int]]:
        yield self.encode(text)

    def encode_array(self, text: str) -> array[int]:
        return array("I", self.encode(text))

    def encode(self, text: str) -> list[int]:
        if self._split is None:
            return self._sp.encode(text)
        ids: list[int] = []
        for i, part in enumerate(self._split.split(text)):
            if i % 2:  # odd parts are the matched control pieces
                ids.append(self._sp.piece_to_id(part))
            elif part:
                ids.extend(self._sp.encode(part))
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        # sentencepiece renders control ids as ""; keep them spelled out unless skipping.
        out: list[str] = []
        run: list[int] = []
        for token_id in ids:
            if token_id in self._special:
                if run:
                    out.append(self._sp.decode(run))
                    run = []
                if not skip_special_tokens:
                    out.append(self._sp.id_to_piece(token_id))
            else:
                run.append(token_id)
        if run:
            out.append(self._sp.decode(run))
        return "".join(out)

    def id_to_token(self, token_id: int) -> str | None:
        return self._sp.id_to_piece(token_id) if 0 <= token_id < self.vocab_size else None

    def token_to_id(self, token: str) -> int | None:
        token_id = self._sp.piece_to_id(token)
        return None if token_id == self._sp.unk_id() and token != self._sp.id_to_piece(token_id) else token_id

    def special_ids(self) -> frozenset[int]:
        return self._special

    def builtin_bos_eos(self) -> tuple[int | None, int | None]:
        bos, eos = self._sp.bos_id(), self._sp.eos_id()  # -1 when the model has none
        return (bos if bos >= 0 else None), (eos if eos >= 0 else None)

    def adds_bos_by_default(self, bos: int) -> bool:
        return True  # sentencepiece (Llama 1/2-style) models are trained with BOS in front


@dataclass(frozen=True)
class TokenizerInfo:
    """What a model's files say around the vocabulary itself."""

    name: str
    bos_token_id: int | None
    eos_token_id: int | None  # the primary one (the template's ``eos_token``)
    eos_token_ids: frozenset[int]  # every id that ends generation, the primary one included
    add_bos_token: bool
    chat_template: str | None


class Tokenizer:
    """Text <-> token ids for one model; cheap to share between requests and threads (read-only
    after construction, but for the backend's internally locked cache of encoded chunks)."""

    def __init__(self, backend: TokenizerBackend, info: TokenizerInfo) -> None:
        self._backend = backend
        self.name = info.name
        self.bos_token_id = info.bos_token_id
        self.eos_token_id = info.eos_token_id
        self.eos_token_ids = info.eos_token_ids
        self.add_bos_token = info.add_bos_token
        self.chat_template = info.chat_template
        self.vocab_size = backend.vocab_size
        self.special_token_ids = backend.special_ids() | info.eos_token_ids | (
            {info.bos_token_id} if info.bos_token_id is not None else set()
        )

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self._backend.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_token_id is None else self._backend.id_to_token(self.eos_token_id)

    def encode(self, text: str, add_special_tokens: bool = True, *,
               max_tokens: int | None = None) -> list[int]:
        """The ids of ``text`` (BOS first when the model adds one). With ``max_tokens``: raises
        ``TooManyTokens`` instead of returning more ids than that, having encoded at most about
        ``max_tokens`` of them where the backend encodes in parts."""
        bos = self._bos(add_special_tokens)
        if max_tokens is None:
            return bos + self._backend.encode(text)
        most = self._backend.max_chars_per_token
        if most is not None and len(text) > (max_tokens - len(bos)) * most:
            raise TooManyTokens(max_tokens)
        ids = bos
        for part in self._backend.parts(text):
            ids.extend(part)
            if len(ids) > max_tokens:
                raise TooManyTokens(max_tokens)
        return ids

    def encode_array(self, text: str, add_special_tokens: bool = True, *,
                     max_tokens: int | None = None) -> np.ndarray:
        """``encode`` as int32 [n] (BOS first when the model adds one), the caller's own. With
        ``max_tokens``: ``TooManyTokens`` as ``encode`` raises it; a text of more than
        ``ARRAY_CHARS_PER_TOKEN * max_tokens`` characters is encoded in parts, stopping early, so
        what is held stays proportional to ``max_tokens`` whatever the text's length."""
        bos = self._bos(add_special_tokens)
        if max_tokens is not None:
            most = self._backend.max_chars_per_token
            if most is not None and len(text) > (max_tokens - len(bos)) * most:
                raise TooManyTokens(max_tokens)
            if len(text) > ARRAY_CHARS_PER_TOKEN * max_tokens:
                return np.asarray(self.encode(text, add_special_tokens, max_tokens=max_tokens), dtype=np.int32)
        packed = np.frombuffer(self._backend.encode_array(text), dtype=np.uint32)   # [n]: ids < 2**31
        if max_tokens is not None and len(bos) + len(packed) > max_tokens:
            raise TooManyTokens(max_tokens)
        if not bos:
            return packed.view(np.int32)
        out = np.empty(len(bos) + len(packed), dtype=np.int32)
        out[:len(bos)] = bos
        out[len(bos):] = packed
        return out

    def encode_ends(self, text: str, add_special_tokens: bool = True, *, head: int,
                    tail: int) -> list[int] | TokenEnds:
        """``encode(text)``, or when it has more than ``head + tail`` ids, a ``TokenEnds`` holding
        its first ``head`` and last ``tail`` ids; the ids in between are never all held at once."""
        first = self._bos(add_special_tokens)
        rest: list[int] = []
        dropped = 0
        for part in self._backend.parts(text):
            room = head - len(first)
            if room > 0:
                first.extend(part[:room])
                part = part[room:]
            rest.extend(part)
            if len(rest) > 2 * tail + (1 << 16):    # amortised: trimmed once per ~tail new ids
                dropped += len(rest) - tail
                del rest[:len(rest) - tail]
        if not dropped and len(rest) <= tail:
            return first + rest
        dropped += max(0, len(rest) - tail)
        kept = rest[len(rest) - tail:] if tail else []
        return TokenEnds(first, kept, len(first) + dropped + len(kept))

    def _bos(self, add_special_tokens: bool) -> list[int]:
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            return [self.bos_token_id]
        return []

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary's string for ``token_id`` (byte-level tokens as the vocabulary spells them)."""
        return self._backend.id_to_token(token_id)

    def decode(self, ids: Sequence[int] | np.ndarray, skip_special_tokens: bool = True) -> str:
        if isinstance(ids, np.ndarray):
            ids = ids.tolist()
        return self._backend.decode(ids, skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str | None]:
        return [self._backend.id_to_token(i) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load from a ``.gguf`` file or a Hugging Face model directory."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path)
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            backend: TokenizerBackend = HFBackend(HFTokenizer.from_file(str(path / "tokenizer.json")))
        elif (path / "tokenizer.model").is_file():
            backend = SentencePieceBackend(
                sentencepiece.SentencePieceProcessor(model_file=str(path / "tokenizer.model"))
            )
        else:
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return _load_gguf(ggufs[0])
            raise ValueError(
                f"{path}: no tokenizer.json or tokenizer.model in this directory, "
                f"and {len(ggufs)} .gguf files (need exactly one)"
            )
        return Tokenizer(backend, _hf_dir_info(path, backend))
    raise ValueError(f"{path}: expected a .gguf file or a model directory")


# --------------------------------------------------------------------------------------------
# Hugging Face directories


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_text(value: Any) -> str | None:
    """tokenizer_config spells a token as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else [int(v) for v in value]


def _hf_dir_info(path: Path, backend: TokenizerBackend) -> TokenizerInfo:
    config = _read_json(path / "tokenizer_config.json")

    def token_id(key: str) -> int | None:
        text = _token_text(config.get(key))
        return None if text is None else backend.token_to_id(text)

    builtin_bos, builtin_eos = backend.builtin_bos_eos()
    bos = token_id("bos_token") if config.get("bos_token") is not None else builtin_bos
    primary_eos = token_id("eos_token") if config.get("eos_token") is not None else builtin_eos
    add_bos = config.get("add_bos_token")
    if add_bos is None:
        add_bos = bos is not None and backend.adds_bos_by_default(bos)
    eos = {primary_eos} if primary_eos is not None else set()
    eos.update(_id_list(_read_json(path / "generation_config.json").get("eos_token_id")))
    eos.update(_id_list(_read_json(path / "config.json").get("eos_token_id")))
    return TokenizerInfo(
        name=path.name,
        bos_token_id=bos,
        eos_token_id=primary_eos if primary_eos is not None else min(eos, default=None),
        eos_token_ids=frozenset(eos),
        add_bos_token=bool(add_bos),
        chat_template=_hf_chat_template(path, config),
    )


def _hf_chat_template(path: Path, config: dict[str, Any]) -> str | None:
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default")
    return template if isinstance(template, str) else None


# --------------------------------------------------------------------------------------------
# GGUF files (llama.cpp metadata keys)

# tokenizer.ggml.token_type values we act on (the others: 2 unknown, 5 unused, 6 byte).
_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 1, 3, 4

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the regexes llama.cpp applies in order before BPE.
_PRE_SPLITS: dict[str, tuple[str, ...]] = {
    **{name: (_GPT2_SPLIT,) for name in ("default", "gpt2", "gpt-2", "olmo", "jais")},
    **{
        name: (r"\p{N}", _GPT2_SPLIT)
        for name in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
    },
    **{name: (_LLAMA3_SPLIT,) for name in ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3")},
    **{name: (_QWEN2_SPLIT,) for name in ("qwen2", "deepseek-r1-qwen", "megrez")},
}


def _read_gguf_metadata(path: Path) -> dict[str, Any]:
    meta = read_metadata(path)
    return {key: value for key, value in meta.items() if key.startswith("tokenizer.") or key == "general.name"}


def _load_gguf(path: Path) -> Tokenizer:
    meta = _read_gguf_metadata(path)
    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tokenizer = _gguf_byte_level(meta)
    elif kind == "llama":
        tokenizer = _gguf_sentencepiece(meta)
    else:
        raise ValueError(f"{path}: unsupported GGUF tokenizer model {kind!r} (supported: 'gpt2', 'llama')")
    _add_gguf_special_tokens(tokenizer, meta)
    eos = {
        int(meta[key])
        for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        if key in meta
    }
    bos = meta.get("tokenizer.ggml.bos_token_id")
    primary_eos = meta.get("tokenizer.ggml.eos_token_id")
    info = TokenizerInfo(
        name=str(meta.get("general.name") or path.stem),
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=None if primary_eos is None else int(primary_eos),
        eos_token_ids=frozenset(eos),
        # llama.cpp's default: sentencepiece vocabularies add BOS unless the file says otherwise.
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")),
        chat_template=meta.get("tokenizer.chat_template"),
    )
    return Tokenizer(HFBackend(tokenizer), info)


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (bytes that print as themselves stay)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}


def _gguf_byte_level(meta: dict[str, Any]) -> HFTokenizer:
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [_TOKEN_NORMAL] * len(tokens)
    alphabet = _byte_alphabet()
    # Ordinary tokens are stored spelled in the byte alphabet; respell any that are not. Control /
    # user-defined ones keep their text: they become added tokens, matched verbatim. Almost every
    # token is spelled already: one scan over all of them, joined by a letter of the alphabet, finds
    # the characters outside it, and with them the few tokens to respell.
    outside = re.compile("[^" + re.escape("".join(alphabet.values())) + "]")
    joined = "!".join(tokens)
    starts = np.cumsum([0] + [len(t) + 1 for t in tokens[:-1]])
    spelled = list(tokens)
    for found in outside.finditer(joined):
        i = int(np.searchsorted(starts, found.start(), side="right")) - 1
        if types[i] not in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED) and spelled[i] is tokens[i]:
            spelled[i] = "".join(alphabet[b] for b in tokens[i].encode("utf-8"))
    vocab = dict(zip(spelled, range(len(spelled))))
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    splits = _PRE_SPLITS.get(pre)
    if splits is None:
        logger.warning("GGUF pre-tokenizer %r is not known; using the GPT-2 split", pre)
        splits = (_GPT2_SPLIT,)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _gguf_sentencepiece(meta: dict[str, Any]) -> HFTokenizer:
    """Sentencepiece BPE as a ``tokenizers`` BPE: merges recovered from the piece scores (SP merges
    the pair whose merged piece scores highest), byte fallback through ``<0xNN>`` pieces."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    scores: list[float] = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [_TOKEN_NORMAL] * len(tokens)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece, score, kind in zip(tokens, scores, types):
        if kind not in (_TOKEN_NORMAL, _TOKEN_USER_DEFINED):
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[left], vocab[right], left, right))
    ranked.sort()
    merges = [(left, right) for _, _, _, left, right in ranked]
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tokenizer = HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            unk_token=None if unk is None else tokens[int(unk)],
            byte_fallback=True,
            fuse_unk=True,
        )
    )
    add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    # Spaces become U+2581, and (as in llama.cpp) each run of text between special tokens gets one
    # in front, even when it already starts with a space.
    spaces = normalizers.Replace(" ", "\u2581")
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), spaces]) if add_prefix else spaces
    strip = [decoders.Strip(" ", 1, 0)] if add_prefix else []
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )
    return tokenizer


def _add_gguf_special_tokens(tokenizer: HFTokenizer, meta: dict[str, Any]) -> None:
    """Control tokens become special added tokens (matched whole, skipped by
    ``skip_special_tokens``); user-defined ones are matched whole but stay ordinary text."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or []
    # Looked up one by one (they are few): nothing is added yet, so these are vocabulary lookups.
    in_vocab = lambda t: tokenizer.token_to_id(t) is not None                 # noqa: E731
    control = [t for t, k in zip(tokens, types) if k == _TOKEN_CONTROL and in_vocab(t)]
    user = [t for t, k in zip(tokens, types) if k == _TOKEN_USER_DEFINED and in_vocab(t)]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
