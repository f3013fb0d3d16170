"""Compile ``StructuredOutput`` constraints to token-level grammars (xgrammar) for one vocabulary.

The vocabulary comes from our ``Tokenizer``: byte-level BPE tokens are passed as their BPE strings,
sentencepiece-style tokens (``▁``, ``<0x0A>``) as byte-fallback pieces; special tokens are passed as
empty strings, so no grammar ever allows them, and the model's EOS ids are the grammar's stop
tokens: a grammar that has reached its end allows only EOS, and the request finishes with ``stop``.

xgrammar is imported on first use (it imports transformers, slow to import) and releases the GIL while it
compiles, so a compile in a worker thread does not stall the step loop.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from radixrelay.structured.emptiness import language_is_empty
from radixrelay.structured.spec import InvalidStructuredOutput, StructuredOutput

if TYPE_CHECKING:
    from radixrelay.text.tokenizer import Tokenizer

CACHE_ENTRIES = 256
COMPACT = (",", ":")           # JSON is one line, ``json.dumps(separators=(",", ":"))``: no optional whitespace
TAG_SEPARATORS = (", ", ": ")  # tool-call arguments: JSON as models write it, ``json.dumps`` defaults
_ENGINE_NOISE = re.compile(r"^\[[\d:]+\] \S+:\d+: ")       # "[01:15:21] /project/cpp/x.cc:83: "
# Why a constraint that compiled is refused when no output can satisfy it (``emptiness``).
_EMPTY = {
    "json_schema": "no JSON value matches this schema (each way through it refers back to itself "
                   "before a value is complete, or a part of it admits no value), so no output could satisfy it",
    "regex": "no string matches this pattern, so no output could satisfy it",
}


class GrammarEngine:
    """Compiles constraints for one tokenizer; thread-safe, with an LRU cache of compiled grammars."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int | None = None, *, threads: int = 1) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size or tokenizer.vocab_size         # logits width (may pad the vocabulary)
        self.info = xgr.TokenizerInfo(_vocabulary(tokenizer), vocab_type=_vocab_type(tokenizer, xgr),
                                      vocab_size=self.vocab_size, stop_token_ids=sorted(tokenizer.eos_token_ids))
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        self._cache: OrderedDict[StructuredOutput, Any] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutput) -> Any:
        """The compiled grammar of ``spec`` (an ``xgrammar.CompiledGrammar``); refusals raise
        ``InvalidStructuredOutput`` with the engine's message."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        compiled = self._compile(spec)
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, compiled: Any) -> Any:
        return self._xgr.GrammarMatcher(compiled)

    def _compile(self, spec: StructuredOutput) -> Any:
        compiler = self._compiler
        try:
            if spec.kind == "json_object":
                compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                        separators=COMPACT, strict_mode=False)
            elif spec.kind == "json_schema":
                compiled = compiler.compile_json_schema(spec.value, any_whitespace=False, separators=COMPACT,
                                                        strict_mode=True)
            elif spec.kind == "regex":
                compiled = compiler.compile_regex(spec.value)
            elif spec.kind == "structural_tag":
                compiled = compiler.compile_structural_tag(self._with_json_grammars(spec.value))
            else:
                compiled = compiler.compile_grammar(choice_grammar(spec.choices))
        except (RuntimeError, ValueError, TypeError) as exc:
            message = _ENGINE_NOISE.sub("", str(exc).strip()).strip()
            raise InvalidStructuredOutput(f"{spec.kind}: {message}") from None
        if self.accepts_nothing(compiled):
            why = _EMPTY.get(spec.kind, "no output can satisfy this constraint")
            raise InvalidStructuredOutput(f"{spec.kind}: {why}")
        return compiled

    def _with_json_grammars(self, tag_json: str) -> str:
        """A structural tag with each ``json_schema`` format replaced by its grammar with fixed
        whitespace (``TAG_SEPARATORS``; a tag's own JSON schemas allow any whitespace, which a small
        model may spend its tokens on), compiled strictly like ``json_schema`` constraints."""
        tag = json.loads(tag_json)
        stack = [tag]
        while stack:
            node = stack.pop()
            if isinstance(node, list):
                stack.extend(node)
            elif isinstance(node, dict):
                for key, child in node.items():
                    if isinstance(child, dict) and child.get("type") == "json_schema" and \
                            child.get("style", "json") == "json":
                        grammar = self._xgr.Grammar.from_json_schema(
                            json.dumps(child["json_schema"]), any_whitespace=False, separators=TAG_SEPARATORS,
                            strict_mode=True)
                        node[key] = {"type": "grammar", "grammar": str(grammar)}
                    elif isinstance(child, (dict, list)):
                        stack.append(child)
        return json.dumps(tag)

    def accepts_nothing(self, compiled: Any) -> bool:
        """Whether no output satisfies ``compiled``: its root derives no finite string
        (``emptiness.language_is_empty``), or, whatever that reading says, no token (not even EOS)
        is allowed first."""
        if language_is_empty(str(compiled.grammar), regex_is_empty=self._regex_is_empty):
            return True
        bitmask = self._xgr.allocate_token_bitmask(1, self.vocab_size)
        self._xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
        return not bool(bitmask.any())

    def _regex_is_empty(self, pattern: str) -> bool | None:
        """Whether no string matches ``pattern`` (a ``Regex`` element of a grammar); None: unknown."""
        try:
            grammar = self._xgr.Grammar.from_regex(pattern)
        except (RuntimeError, ValueError, TypeError):
            return None
        return language_is_empty(str(grammar))


def choice_grammar(choices: tuple[str, ...]) -> str:
    """EBNF whose language is exactly ``choices`` (JSON string escapes are EBNF string escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _vocabulary(tokenizer: Tokenizer) -> list[str]:
    special = tokenizer.special_token_ids
    return ["" if i in special else (tokenizer.convert_ids_to_tokens([i])[0] or "")
            for i in range(tokenizer.vocab_size)]


def _vocab_type(tokenizer: Tokenizer, xgr: Any) -> Any:
    """Byte-level BPE (GPT-2 style ``Ġ`` pieces) or sentencepiece-style byte fallback (``▁``)."""
    pieces = tokenizer.convert_ids_to_tokens(range(min(tokenizer.vocab_size, 4096)))
    if any(p is not None and p.startswith("▁") for p in pieces):
        return xgr.VocabType.BYTE_FALLBACK
    return xgr.VocabType.BYTE_LEVEL
