"""One chat choice's output taken apart: reasoning (``reasoning``), then tool calls (``tool_calls``)
in what follows it, then the answer's text. Streams and whole responses go through the same
``feed`` calls, so a stream's pieces join to exactly the whole response."""

from __future__ import annotations

from dataclasses import dataclass, field

from radixrelay.text.reasoning import ReasoningStream
from radixrelay.text.tool_calls import CallDelta, CallFormat, CallStream, ToolCall


@dataclass
class Pieces:
    """What one ``feed`` decided: new reasoning text, new content text, new call pieces."""

    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


class ChatOutput:
    """``reasoning``: split off a leading reasoning block (``opened``: the prompt opened it);
    ``calls``: the format to read calls in (None: no tool parsing); ``forced``: the output is calls
    from its first character (tool_choice ``required`` or named)."""

    def __init__(self, *, reasoning: bool = False, opened: bool = False, calls: CallFormat | None = None,
                 forced: bool = False) -> None:
        self._reasoning = ReasoningStream(opened=opened) if reasoning else None
        self._calls = CallStream(calls, forced=forced) if calls is not None else None
        self.reasoning_text = ""
        self.content_text = ""

    def feed(self, delta: str, *, final: bool = False) -> Pieces:
        pieces = Pieces()
        if self._reasoning is not None:
            split = self._reasoning.feed(delta, final=final)
            pieces.reasoning, delta = split.reasoning, split.content
        if self._calls is not None:
            pieces.content, pieces.calls = self._calls.feed(delta, final=final)
        else:
            pieces.content = delta
        self.reasoning_text += pieces.reasoning
        self.content_text += pieces.content
        return pieces

    @property
    def separates_reasoning(self) -> bool:
        return self._reasoning is not None

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The calls read (after the final ``feed``)."""
        return [] if self._calls is None else self._calls.calls
