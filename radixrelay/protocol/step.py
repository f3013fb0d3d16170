"""Scheduler -> worker messages: one ``StepPlan`` per step, one ``StepOutput`` back.

The plan is a diff (DESIGN.md): the worker keeps a request table (token ids, page list, sampling
state) and the scheduler only says what changed. Every message is a msgspec struct, so the same
objects travel in-process (Engine) and over ZMQ (server) without pickling.

Invariants the scheduler guarantees:
- a request is ``admitted`` once per residency (again after retraction, with a fresh page list);
  ``released`` rids leave the table before this step's admissions are applied;
- the worker's copy of a request's tokens is prompt + every token it has sampled for it;
- before a step computes positions [start, start + n) of a request, its page list covers them:
  token position t lives in KV slot ``pages[t // page_size] * page_size + t % page_size``;
- positions [0, start) of an extend are already in the KV cache (cached prefix or earlier chunks);
- prompt logprobs: the logits of position t give the logprob of prompt token t + 1. An extend's
  ``[prompt_logprobs_start, prompt_logprobs_start + num_prompt_logprobs)`` are the positions whose
  prompt logprobs are still owed; each position is asked for once per request, in order, and the
  range ends where the chunk ends (or one before, on the chunk that samples).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec

from radixrelay.protocol.cascade import CascadePlan
from radixrelay.protocol.kv import KVAcks, KVTransfers
from radixrelay.sampling_params import SamplingParams


class AdmittedRequest(msgspec.Struct, frozen=True):
    rid: int
    token_ids: list[int]       # tokens [token_offset, L) of prompt + outputs so far (outputs are
                               # non-empty after a retraction)
    num_prompt_tokens: int     # [0, num_prompt_tokens) prompt, [num_prompt_tokens, L) outputs
    pages: list[int]           # initial page list (cached prefix pages + pages for new tokens), after the
                               # ``pages_shared`` pages taken from ``pages_from``
    sampling: SamplingParams
    token_offset: int = 0      # leading tokens left out: cached, never computed in this residency
                               # (0 when the worker needs them all: ``needs_all_tokens``)
    rope_runs: list[tuple[int, int]] = []   # RoPE position of KV index t: t + the delta of the last
                                            # run (first index, delta) with first <= t; none: t
    # ids the sampler must not pick while the request has fewer than ``sampling.min_tokens`` outputs
    # (EOS and stop token ids, as the scheduler stops on them); empty once that many exist
    min_tokens_ban: list[int] = []
    # The page list's first ``pages_shared`` pages are those of request ``pages_from``, admitted earlier in the
    # same plan (a shared cached prefix: a burst over a 112K-token document would otherwise send and decode
    # 7,000 page ids per request). -1: none, ``pages`` is the whole list.
    pages_from: int = -1
    pages_shared: int = 0

    def page_list(self, resident: Callable[[int], Sequence[int]]) -> list[int]:
        """The whole initial page list; ``resident(rid)``: the page list of a request the worker holds."""
        if self.pages_from < 0:
            return list(self.pages)
        pages = list(resident(self.pages_from)[:self.pages_shared])
        pages += self.pages
        return pages


def needs_outputs(sampling: SamplingParams) -> bool:
    """A structured output's grammar replays the request's outputs on (re-)admission: such admissions
    carry every output token even where the cached prefix covers them."""
    return sampling.structured is not None


def needs_all_tokens(sampling: SamplingParams) -> bool:
    """Penalties count every prompt token and prompt logprobs read them as targets: such requests'
    admissions carry the cached prefix's tokens too."""
    return sampling.prompt_logprobs is not None or sampling.has_penalties


class ModuleSpan(msgspec.Struct, frozen=True):
    """One span of cached KV in a modular prompt (a module, anonymous segment or scaffold)."""

    key: str                            # cache namespace: model, schema, module and salt
    token_ids: list[int]                # whole pages: the span's tokens, then placeholder padding
    rope_runs: list[tuple[int, int]]    # (first index, position - index) from that index on
    num_real: int                       # tokens before the padding


def positions_of(runs: Sequence[tuple[int, int]], start: int, stop: int) -> list[int]:
    """The positions of KV indices ``[start, stop)`` under ``runs`` (delta 0 before the first run)."""
    out: list[int] = []
    k, delta = -1, 0
    for i in range(start, stop):
        while k + 1 < len(runs) and runs[k + 1][0] <= i:
            k += 1
            delta = runs[k][1]
        out.append(i + delta)
    return out


class PageAppend(msgspec.Struct, frozen=True):
    rid: int
    pages: list[int]           # appended to the request's page list, in order


class ExtendItem(msgspec.Struct, frozen=True):
    rid: int
    start: int                 # first position computed this step; [0, start) is cached
    num_tokens: int            # computes token_ids[start : start + num_tokens]
    sample: bool               # True on the chunk that ends the known tokens: sample the next one
    prompt_logprobs_start: int = 0   # first position whose logits give a prompt logprob
    num_prompt_logprobs: int = 0     # 0: this chunk reports no prompt logprobs


class StepPlan(msgspec.Struct, frozen=True):
    step_id: int
    released: list[int] = []               # rids that leave the table (finished, aborted, retracted)
    admitted: list[AdmittedRequest] = []
    page_appends: list[PageAppend] = []
    extends: list[ExtendItem] = []          # prefill / chunked prefill / resume work
    decodes: list[int] = []                 # rids computing one token: their last known token
    cascade: CascadePlan | None = None      # shared levels of the decode rows (radixrelay.protocol.cascade)
    transfers: KVTransfers | None = None    # KV tier copies (None: none)
    # partial pages reused (``CacheManager.reuse_partial_page``): (source page, destination page, n), the first
    # n positions of the source copied into the destination's, every layer, before the forward
    page_copies: list[tuple[int, int, int]] = []


class TokenLogprobs(msgspec.Struct, frozen=True):
    logprob: float                          # natural log of the sampled token's probability
    top: list[tuple[int, float]]            # (token id, logprob), best first


class PromptLogprobsChunk(msgspec.Struct, frozen=True):
    rid: int
    first_token: int                        # prompt index of entries[0] (>= 1: token 0 has none)
    entries: list[TokenLogprobs]            # prompt tokens [first_token, first_token + len), in order


class StepOutput(msgspec.Struct, frozen=True):
    step_id: int
    rids: list[int]                         # the requests that sampled a token this step
    token_ids: list[int]                    # the sampled token of each, same order
    logprobs: list[TokenLogprobs | None] | None = None  # same order; None for requests without
    prompt_logprobs: list[PromptLogprobsChunk] = []     # one per extend that owed prompt logprobs
    error: str | None = None                # set when the step failed; the scheduler fails the batch
    failed: list[tuple[int, str]] = []      # (rid, why): requests this step failed alone (their tokens
                                            # are dropped); the rest of the batch goes on
    kv_acks: KVAcks | None = None           # KV tier transfers completed (None: none)
