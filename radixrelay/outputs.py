"""What the offline API returns."""

from __future__ import annotations

from dataclasses import dataclass

from radixrelay.protocol.step import TokenLogprobs


@dataclass(frozen=True)
class RequestOutput:
    text: str                          # generated text (stop string and what followed removed)
    token_ids: list[int]               # generated tokens (a matched stop token is not included)
    finish_reason: str                 # "stop" | "length" | "abort"
    prompt_tokens: int
    cached_tokens: int                 # prompt tokens served from the radix cache
    completion_tokens: int             # tokens sampled, a matched stop token included
    logprobs: list[TokenLogprobs] | None = None   # per generated token, when requested
    # Per prompt token when requested (SamplingParams.prompt_logprobs), None for token 0.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    error: str | None = None           # set when the request failed inside the engine
    module_tokens: int = 0             # of the cached tokens, module KV (prompts against a schema)
