"""Context overflow: left truncation of a prompt that no longer fits, with KV that stays usable.

With ``--truncation R`` a prompt whose tokens plus ``max_tokens`` exceed the context window loses its
oldest tokens, whole chunks at a time, instead of being refused (AttentionStore 3.4). The first page
(at least 4 tokens) is kept: it holds the start of the prompt (BOS, the system prompt's first tokens)
that the model's attention leans on as a sink (StreamingLLM); without it, re-positioned KV agrees
far less often with recomputation. The chunk is ``ceil(R * context)`` rounded up to whole KV pages,
and ``k`` chunks after the head are dropped for the smallest ``k`` that makes the prompt fit. So the truncation point of a growing conversation is stable: turns that
fit after dropping ``k`` chunks all keep the same suffix (plain prefix hits), and when the
conversation overflows again the point moves by one more chunk.

When it moves, the KV cached for the previous truncation point stays usable: the kept tokens are the
previous sequence without its first chunk, so their cached pages (those past the chunk) are loaded
from the lower tiers with their keys rotated by ``-chunk`` positions (RoPE: rotating a key by a
position delta is exact). ``shifted_prefix`` is the chunk that was dropped since the previous
truncation point, at ``shifted_at`` (the head's length): the scheduler finds the cached pages under
the content keys of ``ids[:shifted_at] + shifted_prefix + ids[shifted_at:]``. The re-positioned KV of the kept tokens still reflects the attention they
paid to the dropped tokens when it was computed; that is the approximation the paper evaluates
(recomputing the truncated prompt gives slightly different KV at layers above the first).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Truncated:
    ids: Sequence[int]                  # the prompt to serve (the original when nothing was dropped): a list,
                                        # or a frontend's validated int32 numpy array of ids (sent packed)
    dropped: int = 0                    # tokens dropped after the head
    shifted_prefix: list[int] = field(default_factory=list)   # dropped since the previous point
    shifted_at: int = 0                 # where ``shifted_prefix`` was (the kept head's length)


@dataclass(frozen=True)
class Truncation:
    """Left truncation in chunks of ``ratio`` of the context (``radixrelay.radix.truncation``)."""

    ratio: float
    context: int                        # the model's context window, tokens
    page_size: int

    def __post_init__(self) -> None:
        if not 0 < self.ratio < 1:
            raise ValueError(f"truncation ratio must be in (0, 1), got {self.ratio}")

    @property
    def head(self) -> int:
        """Tokens kept at the front: whole pages, at least 4 tokens (the attention sink)."""
        return -(-4 // self.page_size) * self.page_size

    @property
    def chunk(self) -> int:
        """Tokens dropped per overflow: ``ratio`` of the context, rounded up to whole pages."""
        ps = self.page_size
        return -(-math.ceil(self.ratio * self.context) // ps) * ps

    def apply(self, ids: Sequence[int] | np.ndarray, max_tokens: int) -> Truncated:
        """The prompt to serve so that ``len(ids) + max_tokens`` fits the context (an array stays an array,
        a list a list). Raises ``ValueError`` when no whole number of chunks makes it fit (``max_tokens`` too
        large)."""
        limit = self.context - max_tokens
        if len(ids) <= limit:
            return Truncated(ids)
        chunk, head = self.chunk, self.head
        k = -(-(len(ids) - limit) // chunk)
        drop = k * chunk
        if head + drop >= len(ids) or limit <= head:
            raise ValueError(f"the prompt has {len(ids)} tokens and max_tokens is {max_tokens}: "
                             f"dropping the oldest tokens in chunks of {chunk} cannot make it fit "
                             f"the context of {self.context} tokens")
        shifted = ids[head + drop - chunk:head + drop]
        if isinstance(ids, np.ndarray):
            return Truncated(np.concatenate((ids[:head], ids[head + drop:])), drop, shifted.tolist(), head)
        return Truncated(ids[:head] + ids[head + drop:], drop, shifted, head)
