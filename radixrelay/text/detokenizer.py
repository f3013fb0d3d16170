"""Incremental detokenization and stop strings, one state object per request.

``IncrementalDetokenizer`` turns a growing list of token ids into text deltas with two decodes of a
short window per step, never a decode of the whole output. The window holds the ids of the last
emitted delta (or the prompt's tail) followed by the ids not emitted yet:

    window = [ emitted ... | pending ... ]        (split at ``read``)
    delta  = decode(window)[len(decode(window[:read])):]

Decoding from one delta back, rather than from ``read``, keeps the context a sentencepiece decoder
needs for leading spaces (it strips the space of the first token it sees). When ``decode(window)``
ends in U+FFFD the newest tokens end inside a multi-byte UTF-8 character: the delta is held back
until a later token completes it (``finish`` releases whatever remains, so a genuinely invalid
byte run still reaches the caller as U+FFFD). After a delta is emitted the window restarts at the
ids that produced it.

Invariant: the concatenation of every delta plus ``finish()`` equals ``decode(ids)`` when no context
is given, and ``decode(context + ids)[len(decode(context)):]`` with one (so the first output token
keeps its leading space after a prompt). For byte-level BPE this holds for any id sequence; for
sentencepiece byte fallback it holds whenever the text is valid UTF-8 (on invalid runs the
library's replacement count depends on where a run starts).

Stop strings are matched by the scheduler on the same incremental text (``radixrelay.scheduler.stop``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from radixrelay.text.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 5  # prompt tokens kept as decode context for the first output token


class IncrementalDetokenizer:
    """Per-request decoder state; feed sampled ids with ``add``, get the text they complete."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        skip_special_tokens: bool = True,
        context_ids: Sequence[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        # Output ids follow the last few prompt ids, which are decoded but never emitted. A prompt
        # that ends inside a character gives no clean boundary: those ids are left out. (int(): the
        # Engine's prompts are numpy arrays.)
        self._window: list[int] = list(map(int, context_ids[-_CONTEXT_TOKENS:]))
        while self._window and tokenizer.decode(self._window, skip_special_tokens=self._skip).endswith(
            _REPLACEMENT
        ):
            self._window.pop()
        self._read = len(self._window)  # [0, read) emitted or context, [read, len) pending

    def add(self, token_ids: Iterable[int]) -> str:
        """Append sampled ids; returns the newly completed text (possibly empty)."""
        self._window.extend(token_ids)
        return self._delta(final=False)

    def finish(self) -> str:
        """Text still held back (an incomplete character at the very end), as U+FFFD."""
        return self._delta(final=True)

    def _delta(self, *, final: bool) -> str:
        if self._read == len(self._window):
            return ""
        decode = self._tokenizer.decode
        prefix_text = decode(self._window[: self._read], skip_special_tokens=self._skip)
        full_text = decode(self._window, skip_special_tokens=self._skip)
        if not final and (len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT)):
            return ""  # nothing new yet, or the newest bytes do not complete a character
        del self._window[: self._read]
        self._read = len(self._window)
        return full_text[len(prefix_text) :]
