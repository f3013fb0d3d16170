"""``select`` scoring from prompt logprobs (OpenAI completions with ``echo`` and ``logprobs``).

One request scores all choices: ``prompt = [prefix, prefix + c_1, ..., prefix + c_k]``, ``echo``,
``logprobs=0``, ``max_tokens=1``. Each echoed entry lists the prompt's tokens with their
log-probabilities (the first token has none), then the one generated token, which is dropped: a
token belongs to the prompt while its ``text_offset`` is inside the prompt text.

The tokens of a choice are ``tokens(prefix + c)`` minus the longest common leading run with
``tokens(prefix)``. When BPE merges across the boundary (the prefix's last token changes once the
choice follows), the merged token counts as the choice's: it is needed to spell the choice.
A choice's score is the mean of its tokens' log-probabilities (natural log).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from radixrelay.lang.errors import BackendError

Entry = tuple[str, float | None]        # (token text, logprob)


def prompt_entries(logprobs: Mapping[str, Any] | None, prompt: str) -> list[Entry]:
    """The prompt tokens of one echoed choice's ``logprobs`` object."""
    if not logprobs or logprobs.get("token_logprobs") is None:
        raise BackendError("the backend returned no prompt logprobs for echo=true, logprobs=0")
    tokens, values, offsets = logprobs["tokens"], logprobs["token_logprobs"], logprobs["text_offset"]
    if not len(tokens) == len(values) == len(offsets):
        raise BackendError("malformed logprobs: tokens, token_logprobs and text_offset differ in length")
    return [(t, v) for t, v, off in zip(tokens, values, offsets) if off < len(prompt)]


def choice_score(prefix_entries: Sequence[Entry], full_entries: Sequence[Entry]) -> float:
    common = 0
    for (a, _), (b, _) in zip(prefix_entries, full_entries):
        if a != b:
            break
        common += 1
    own = full_entries[common:]
    if not own:
        raise BackendError("a choice has no tokens of its own after the prefix")
    values = [v for _, v in own]
    if any(v is None for v in values):
        raise BackendError("the backend returned no logprob for a choice token")
    return sum(values) / len(values)   # type: ignore[arg-type]
