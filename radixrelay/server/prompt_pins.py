"""Pinned prefixes asked by an HTTP request: OpenAI's ``prompt_cache_retention: "24h"`` (the whole prompt) and
Anthropic-style ``cache_control`` marks on chat messages (the prompt up to the marked point), as the
scheduler's ``PinSpec``s (``radixrelay.scheduler.pins``).

A mark is ``{"type": "ephemeral"}`` with an optional ``ttl`` of ``"5m"`` (the default) or ``"1h"``, on a
message or on one of its text parts. Its token boundary is found by rendering: the messages before the
marked one, then the marked one (its content cut after the marked part), rendered by the same template
call without a generation prompt, encoded, and compared with the prompt's tokens; the pin covers their
common prefix. So a boundary inside a template's markup, or a token merged across it, only makes the pin a
few tokens shorter, never wrong. The scheduler rounds each pin down to whole KV pages.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from radixrelay.protocol.messages import PinSpec
from radixrelay.server import openai_protocol as oa

RETENTION_24H_S = 24 * 3600.0
CACHE_TTLS = {"5m": 300.0, "1h": 3600.0}
MAX_MARKS = 4                       # as Anthropic's limit on cache breakpoints (the scheduler's MAX_PINS)


def retention_pins(retention: str | None, num_tokens: int) -> list[PinSpec]:
    """``prompt_cache_retention``: "24h" pins the whole prompt for 24 hours after its last use."""
    return [PinSpec(num_tokens, RETENTION_24H_S)] if retention == "24h" else []


def _ttl(mark: Any, where: str) -> float | None:
    """A ``cache_control`` value's TTL in seconds (None: no mark); 400 for a malformed one."""
    if mark is None:
        return None
    if not isinstance(mark, Mapping) or mark.get("type") != "ephemeral":
        raise oa.invalid(f'{where}.cache_control: expected {{"type": "ephemeral", "ttl": "5m" | "1h"}}', "messages")
    ttl = mark.get("ttl", "5m")
    if ttl not in CACHE_TTLS or set(mark) - {"type", "ttl"}:
        raise oa.invalid(f'{where}.cache_control: ttl must be "5m" or "1h" (no other keys), got {dict(mark)}',
                         "messages")
    return CACHE_TTLS[ttl]


def cache_marks(messages: Sequence[Any]) -> list[tuple[list[Any], float]]:
    """Each ``cache_control`` mark as (the conversation up to it, its TTL): the messages before the marked
    one, then the marked one with its content cut after the marked part. 400 for a malformed mark or more
    than ``MAX_MARKS``."""
    marks: list[tuple[list[Any], float]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            continue                                 # the template's validation names it
        ttl = _ttl(message.get("cache_control"), f"messages[{i}]")
        content = message.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                part_ttl = _ttl(part.get("cache_control") if isinstance(part, Mapping) else None,
                                f"messages[{i}].content[{j}]")
                if part_ttl is not None:
                    marks.append(([*messages[:i], {**message, "content": content[:j + 1]}], part_ttl))
        if ttl is not None:
            marks.append((list(messages[:i + 1]), ttl))
    if len(marks) > MAX_MARKS:
        raise oa.invalid(f"at most {MAX_MARKS} cache_control marks per request, got {len(marks)}", "messages")
    return marks


def chat_pins(marks: list[tuple[list[Any], float]], prompt_ids: np.ndarray | Sequence[int],
              render: Callable[[list[Any]], str], encode: Callable[[str], np.ndarray]) -> list[PinSpec]:
    """The pins of ``marks`` (``cache_marks``) over the prompt ``prompt_ids``: ``render(messages)`` renders a
    conversation prefix without a generation prompt, ``encode`` tokenizes it as the prompt was."""
    prompt = np.asarray(prompt_ids)
    pins = []
    for messages, ttl in marks:
        try:
            ids = encode(render(messages))
        except ValueError as exc:
            raise oa.invalid(f"cache_control: the chat template cannot render the conversation up to the mark "
                             f"({exc})", "messages") from None
        n = min(len(ids), len(prompt))
        differ = np.flatnonzero(ids[:n] != prompt[:n])
        pins.append(PinSpec(int(differ[0]) if len(differ) else n, ttl))
    return pins
