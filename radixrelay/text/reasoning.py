"""Reasoning kept apart from the answer, for models that think inside ``<think>...</think>``.

An output's reasoning is its leading ``<think>`` block, or, when the prompt already opened the block
(templates of DeepSeek-R1 and of Qwen3 with thinking forced end the generation prompt with
``<think>``), everything up to the first ``</think>``. Whitespace right after either marker is
dropped; the answer (``content``) is everything after ``</think>``. An output that never closes its
block is all reasoning (cut by ``max_tokens``); one that does not start with ``<think>`` (and was
not opened by the prompt) is all content.

``ReasoningStream`` is monotone like ``tool_calls.CallStream``: what it sends is never taken back;
text that may be the start of a marker is held until decided.
"""

from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"
PARSERS = ("think",)               # --reasoning-parser choices besides 'auto' and 'none'


def template_thinks(template: str | None) -> bool:
    """Whether a chat template writes reasoning blocks (it names the closing marker)."""
    return template is not None and CLOSE in template


def prompt_opens_reasoning(prompt: str) -> bool:
    """Whether the rendered prompt ends inside an open reasoning block."""
    tail = prompt.rstrip()
    return tail.endswith(OPEN)


def _held(tail: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(tail)), 0, -1):
        if marker.startswith(tail[-k:]):
            return k
    return 0


@dataclass
class Split:
    reasoning: str
    content: str


def split(text: str, *, opened: bool, final: bool) -> Split:
    """The decided reasoning and content of ``text`` (the output so far); ``opened``: the prompt
    opened the block."""
    if opened:
        start = 0
    else:
        lead = len(text) - len(text.lstrip())
        rest = text[lead:]
        if rest.startswith(OPEN):
            start = lead + len(OPEN)
        elif not final and OPEN.startswith(rest):
            return Split("", "")                     # may still become '<think>'
        else:
            return Split("", text)
    body_start = len(text) - len(text[start:].lstrip())
    end = text.find(CLOSE, body_start)
    if end < 0:
        body = text[body_start:]
        keep = len(body) if final else len(body) - _held(body, CLOSE)
        return Split(body[:keep], "")
    content = text[end + len(CLOSE):].lstrip()
    return Split(text[body_start:end], content)


class ReasoningStream:
    """``split`` fed piece by piece, in time linear in the output: only undecided text is kept (the
    output's start until it is clear whether it opens a block; a tail that may begin ``</think>``)."""

    def __init__(self, *, opened: bool) -> None:
        self._state = "reasoning" if opened else "start"      # start | reasoning | content
        self._strip = opened          # whitespace at the start of the reasoning or the content is dropped
        self._pending = ""

    def feed(self, delta: str, *, final: bool = False) -> Split:
        """The reasoning and content text new since the last call."""
        text, self._pending = self._pending + delta, ""
        if self._state == "start":
            rest = text.lstrip()
            if rest.startswith(OPEN):
                self._state, self._strip, text = "reasoning", True, rest[len(OPEN):]
            elif not final and OPEN.startswith(rest):
                self._pending = text                           # may still become '<think>'
                return Split("", "")
            else:
                self._state = "content"
        reasoning = ""
        if self._state == "reasoning":
            if self._strip:
                text = text.lstrip()
                self._strip = not text
            end = text.find(CLOSE)
            if end < 0:
                keep = len(text) if final else len(text) - _held(text, CLOSE)
                self._pending = text[keep:]
                return Split(text[:keep], "")
            reasoning, text = text[:end], text[end + len(CLOSE):]
            self._state, self._strip = "content", True
        if self._strip:
            text = text.lstrip()
            self._strip = not text
        return Split(reasoning, text)
