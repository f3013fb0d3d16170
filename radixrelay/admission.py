"""One admission path for the frontends (the HTTP server, the ``Engine``): a prompt becomes the token ids
the runtime serves, fitted to the model's context, with its max_tokens.

- Text is encoded with the model's tokenizer (``Tokenizer.encode_array``: int32; a remembered prefix costs
  a slice) in memory bounded by the context: without truncation a prompt is refused once it is known to
  exceed ``EXACT_COUNT_FACTOR`` contexts ("more than N tokens"); with truncation only the ids truncation
  may serve are held (``Tokenizer.encode_ends``).
- Token ids are checked with numpy, never a Python loop per id: integers (an integral float counts as
  that integer: 4.0 is 4, as JSON Schema has it) within the vocabulary.
- A prompt against a registered schema (modular prompt reuse) is composed by the caller (its errors are
  ``SchemaError``s) and fitted here: never truncated, its positions and its KV must both fit.

Fitting: max_tokens as given (``Budget.requested``) or, left out, ``Budget.default`` (None: all the context
the KV cache leaves the prompt) must be at least 1 and fit the context with the prompt; with truncation
(``--truncation``) a prompt that does not fit loses its oldest tokens (``radixrelay.radix.truncation``)
instead of being refused.

Every refusal is an ``AdmissionError``, a ``ValueError`` naming the request field at fault: the server
answers it as a 400 with that ``param``, the Engine raises it as it is, with the same message. Prompts
come out as int32 [n] arrays, sent to the scheduler packed (``radixrelay.protocol.token_ids``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from radixrelay.modules.compose import ComposedPrompt
from radixrelay.radix.truncation import Truncated, Truncation
from radixrelay.text.tokenizer import TokenEnds, Tokenizer, TooManyTokens

EXACT_COUNT_FACTOR = 2      # an over-context prompt's tokens are counted up to this many contexts


class AdmissionError(ValueError):
    """A prompt or its max_tokens refused; ``param`` names the request field at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Limits:
    """What admission checks against: the running model's, known once the runtime is up."""

    max_context: int                      # tokens: prompt + max_tokens fit in it
    kv_cache_tokens: int                  # tokens the KV cache holds
    vocab_size: int                       # token ids are in [0, vocab_size)
    truncation: Truncation | None = None  # context overflow drops the oldest tokens (else refused)


@dataclass(frozen=True)
class Budget:
    """A request's output length and the names its errors give."""

    requested: int | None                 # max_tokens as given; None: ``default``
    default: int | None = None            # None: all the context the KV cache leaves the prompt
    param: str = "max_tokens"             # the field ``requested`` came from
    prompt_param: str = "prompt"          # the field the prompt came from


@dataclass(frozen=True)
class Admitted:
    prompt: Truncated                     # ids: int32 [n], what the runtime serves
    max_tokens: int


def checked_ids(values: Sequence[Any] | np.ndarray, vocab_size: int, param: str = "prompt") -> np.ndarray:
    """``values`` as token ids, int32 [n]: integers (or integral floats) in ``[0, vocab_size)``, at least one;
    else ``AdmissionError``. A list is converted once by numpy; an integer array is only range-checked."""
    arr = values if isinstance(values, np.ndarray) else _as_array(values)
    if arr is not None and arr.ndim == 1 and not arr.size:
        raise AdmissionError("prompt is empty", param)
    not_integers = f"prompt token ids must be integers in [0, {vocab_size})"
    if arr is None or arr.ndim != 1 or arr.dtype.kind not in "iuf":
        raise AdmissionError(not_integers, param)      # strings, None, bools, lists, ints past 64 bits
    if arr.dtype.kind == "f":
        fractional = ~np.isfinite(arr) | (arr != np.floor(arr))
        if fractional.any():
            raise AdmissionError(f"{not_integers}, got {arr[fractional][0]}", param)
    if arr.min() < 0 or arr.max() >= vocab_size:
        bad = arr[(arr < 0) | (arr >= vocab_size)][:5]
        raise AdmissionError(f"prompt token ids out of range [0, {vocab_size}): {bad.tolist()}", param)
    return arr.astype(np.int32, copy=False)


def _as_array(values: Sequence[Any]) -> np.ndarray | None:
    """``values`` as a numpy array of the kind numpy finds (None: ragged)."""
    try:
        return np.asarray(values)
    except (ValueError, TypeError, OverflowError):
        return None


class Admission:
    """Prompts -> ``Admitted`` for one model (its tokenizer and ``Limits``); safe to share between threads."""

    def __init__(self, tokenizer: Tokenizer, limits: Limits) -> None:
        self.tokenizer = tokenizer
        self.limits = limits

    def text(self, text: str, budget: Budget, *, add_special_tokens: bool = True) -> Admitted:
        """A text prompt encoded (BOS first when ``add_special_tokens`` and the model adds one) and fitted."""
        t, limit = self.limits.truncation, self.limits.max_context
        ids: np.ndarray | list[int] | TokenEnds
        if t is not None and self._truncates(budget):
            # Truncation keeps the head and at most ``limit`` ids after it; ``shifted_prefix`` is the chunk
            # before those.
            ids = self.tokenizer.encode_ends(text, add_special_tokens, head=t.head, tail=limit + t.chunk)
        else:
            bound = EXACT_COUNT_FACTOR * limit
            try:
                ids = self.tokenizer.encode_array(text, add_special_tokens, max_tokens=bound)
            except TooManyTokens:
                raise AdmissionError(f"the prompt has more than {bound} tokens; this model's context is "
                                     f"{limit} tokens", budget.prompt_param) from None
        if not len(ids):
            raise AdmissionError("prompt is empty", budget.prompt_param)
        return self.fit(ids, budget)

    def token_ids(self, values: Sequence[Any] | np.ndarray, budget: Budget) -> Admitted:
        """A token-id prompt checked (``checked_ids``) and fitted."""
        return self.fit(checked_ids(values, self.limits.vocab_size, budget.prompt_param), budget)

    def fit(self, ids: np.ndarray | list[int] | TokenEnds, budget: Budget) -> Admitted:
        """The prompt to serve and its max_tokens: with truncation, a prompt that does not fit the context
        with its max_tokens (at least 1 token when none is given) loses its oldest tokens. ``ids`` may be
        a ``TokenEnds`` only when it is that long."""
        t, limit = self.limits.truncation, self.limits.max_context
        want = budget.requested if budget.requested is not None else (budget.default or 1)
        prompt = Truncated(ids)
        if t is not None and len(ids) + want > limit and 1 <= want < limit:
            try:
                prompt = t.apply(ids, want)
            except ValueError as exc:
                raise AdmissionError(str(exc), budget.param) from None
        assert not isinstance(prompt.ids, TokenEnds)
        if not isinstance(prompt.ids, np.ndarray):
            prompt = replace(prompt, ids=np.asarray(prompt.ids, dtype=np.int32))
        return Admitted(prompt, self.max_tokens(len(prompt.ids), budget))

    def composed(self, composed: ComposedPrompt, budget: Budget) -> int:
        """max_tokens of a prompt composed against a schema (never truncated): its positions and its KV
        must both fit."""
        limit = self.limits.max_context
        if composed.end_position >= limit:
            raise AdmissionError(f"the prompt's new text ends at position {composed.end_position} of its "
                                 f"schema; this model's context is {limit} tokens", budget.prompt_param)
        return self.max_tokens(max(composed.end_position, len(composed.token_ids)), budget)

    def max_tokens(self, prompt_len: int, budget: Budget) -> int:
        """``budget``'s max_tokens for a prompt of ``prompt_len`` tokens, or ``AdmissionError``."""
        limit = self.limits.max_context
        requested = budget.requested
        if prompt_len >= limit:
            raise AdmissionError(f"the prompt has {prompt_len} tokens; this model's context is {limit} tokens",
                                 budget.prompt_param)
        if requested is None:
            requested = budget.default or min(limit, self.limits.kv_cache_tokens) - prompt_len
            if requested < 1:
                raise AdmissionError(f"the prompt has {prompt_len} tokens, more than the KV cache holds "
                                     f"({self.limits.kv_cache_tokens})", budget.prompt_param)
        if requested < 1:
            raise AdmissionError(f"{budget.param} must be >= 1, got {requested}", budget.param)
        if prompt_len + requested > limit:
            raise AdmissionError(f"this model's context is {limit} tokens; the prompt ({prompt_len} tokens) "
                                 f"plus {budget.param} ({requested}) exceeds it", budget.param)
        return requested

    def _truncates(self, budget: Budget) -> bool:
        """Whether an over-long prompt would be truncated (else it is refused)."""
        want = budget.requested if budget.requested is not None else (budget.default or 1)
        return self.limits.truncation is not None and 1 <= want < self.limits.max_context
