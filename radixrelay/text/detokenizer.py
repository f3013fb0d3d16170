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

``StopStringMatcher`` sits after the detokenizer: it holds back any tail that could still become a
stop string, so no partial stop string is ever emitted, and truncates before the first one found.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

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


@dataclass(frozen=True)
class StopResult:
    text: str      # safe to emit now
    stopped: bool  # a stop string was found; ``text`` ends right before it
    stop: str | None = None


class StopStringMatcher:
    """Filters a stream of text deltas against stop strings (the stop string itself is dropped)."""

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(stops)
        self._held = ""
        self.stopped = False

    def feed(self, delta: str) -> StopResult:
        if self.stopped:
            raise RuntimeError("StopStringMatcher.feed after a stop string was found")
        text = self._held + delta
        found = self._first_stop(text)
        if found is not None:
            index, stop = found
            self.stopped = True
            self._held = ""
            return StopResult(text[:index], True, stop)
        keep = self._longest_partial_suffix(text)
        self._held = text[len(text) - keep:]
        return StopResult(text[: len(text) - keep], False)

    def flush(self) -> str:
        """At the end of generation (no stop string): the held tail is ordinary text."""
        held, self._held = self._held, ""
        return held

    def _first_stop(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self._stops:
            index = text.find(stop)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _longest_partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
