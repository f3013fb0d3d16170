"""Per-request sampling and stopping parameters.

One struct crosses every boundary (Engine API -> scheduler -> worker), so it is a frozen
``msgspec.Struct``; ``__post_init__`` validates and raises ``ValueError`` with the field name.
"""

from __future__ import annotations

import math

import msgspec

from radixrelay.structured.spec import StructuredOutput

SEED_RANGE = (-(2 ** 63), 2 ** 63 - 1)     # a seed is a signed 64-bit integer
INT64_MAX = 2 ** 63 - 1                    # every integer crosses process boundaries as msgpack int64
# Stop strings per request and characters per stop string. The scheduler's stop check costs O(new
# characters) per token whatever the list; the bounds cap its per-request automaton (count x length
# states) and the characters held back while a stop string might still begin.
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 256
# Stop token ids per request. The scheduler tests each sampled token against the list (a scan of the
# tuple; 256 ids: microseconds, 192K: milliseconds per token that the batch mates wait for) and the
# list travels with the request between processes.
# Duplicates are allowed and count; ids must be below the model's vocabulary (checked where it is
# known: the server's 400, ``Engine.generate``'s ValueError).
MAX_STOP_TOKEN_IDS = 256
# Entries of ``logit_bias`` per request (OpenAI's bound on its own API): the sampler adds them to the
# logits row by row, and they travel with the request between processes.
MAX_LOGIT_BIAS = 300
LOGIT_BIAS_RANGE = (-100.0, 100.0)


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    max_tokens: int = 16
    temperature: float = 1.0          # 0 means greedy
    top_p: float = 1.0                # nucleus mass kept, (0, 1]
    top_k: int = -1                   # -1 (or 0) disables
    min_p: float = 0.0                # drop tokens with p < min_p * p_max, [0, 1]
    seed: int | None = None           # per-request generator: reproducible regardless of batch mates
    repetition_penalty: float = 1.0   # HF-style, over prompt + output tokens, > 0
    frequency_penalty: float = 0.0    # OpenAI-style, over output tokens, [-2, 2]
    presence_penalty: float = 0.0     # OpenAI-style, over output tokens, [-2, 2]
    stop: tuple[str, ...] = ()        # stop strings: generation ends before them, never emitted
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None       # None: no logprobs; k >= 0: sampled token's + top-k alternatives
    # None: no prompt logprobs; k >= 0: each prompt token's logprob + top-k alternatives (the first
    # token has none). Such a request computes its whole prompt: it reuses no cached prefix (cached
    # positions have no logits), though its KV is still inserted into the radix cache afterwards.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Output constraint (JSON schema, JSON object, regex, choice): disallowed tokens are masked before
    # sampling; a grammar that reaches its end allows only EOS, so the request ends with "stop".
    structured: StructuredOutput | None = None
    # (token id, bias) pairs added to the logits before penalties and sampling (OpenAI: -100 bans a token
    # in practice, +100 forces it); ids must be below the model's vocabulary (checked where it is known)
    logit_bias: tuple[tuple[int, float], ...] = ()
    # EOS and ``stop_token_ids`` cannot be sampled before this many output tokens (vLLM's meaning: stop
    # strings still end the output); at most ``max_tokens``
    min_tokens: int = 0

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{field}: {why}")

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) \
                or not 1 <= self.max_tokens <= INT64_MAX:
            raise bad("max_tokens", f"must be an integer in [1, 2**63 - 1], got {self.max_tokens!r}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                     "presence_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(name, f"must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not -1 <= self.top_k <= INT64_MAX:
            raise bad("top_k", f"must be -1 (disabled), 0 (disabled) or in [1, 2**63 - 1], got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                raise bad(name, f"must be in [-2, 2], got {value}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= 20):
                raise bad(name, f"must be None or an integer in [0, 20], got {value!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            raise bad("seed", f"must be None or a signed 64-bit integer, got {self.seed!r}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise bad("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop token ids are accepted, "
                                        f"got {len(self.stop_token_ids)}")
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= INT64_MAX
               for t in self.stop_token_ids):
            raise bad("stop_token_ids", f"must be token ids (integers >= 0), got {list(self.stop_token_ids)!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "stop strings must be non-empty strings")
        if problem := stop_strings_problem(self.stop):
            raise bad("stop", problem)
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise bad("logit_bias", f"at most {MAX_LOGIT_BIAS} entries are accepted, got {len(self.logit_bias)}")
        for entry in self.logit_bias:
            if (not isinstance(entry, tuple) or len(entry) != 2 or isinstance(entry[0], bool)
                    or not isinstance(entry[0], int) or not 0 <= entry[0] <= INT64_MAX
                    or isinstance(entry[1], bool) or not isinstance(entry[1], (int, float))
                    or not LOGIT_BIAS_RANGE[0] <= entry[1] <= LOGIT_BIAS_RANGE[1]):
                raise bad("logit_bias", f"entries must be (token id >= 0, bias in [-100, 100]), got {entry!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) \
                or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", f"must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        if self.structured is not None and self.min_tokens:
            raise bad("min_tokens", "cannot be combined with a structured output: the constraint may end the "
                                    "output with EOS")
        if self.structured is not None and self.ignore_eos:
            raise bad("ignore_eos", "cannot be combined with a structured output: the constraint ends the "
                                    "output with EOS")

    @property
    def has_penalties(self) -> bool:
        """A repetition, frequency or presence penalty applies (the sampler needs token counts)."""
        return self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def stop_strings_problem(stops: tuple[str, ...] | list[str]) -> str | None:
    """Why ``stops`` is past the bounds on stop strings, or None."""
    if len(stops) > MAX_STOP_STRINGS:
        return f"at most {MAX_STOP_STRINGS} stop strings are accepted, got {len(stops)}"
    longest = max(map(len, stops), default=0)
    if longest > MAX_STOP_STRING_CHARS:
        return f"a stop string has at most {MAX_STOP_STRING_CHARS} characters, got one of {longest}"
    return None
