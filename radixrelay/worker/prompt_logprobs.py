"""Prompt logprobs of one extend chunk, computed on the device from the chunk's logits rows.

The logits of position t give the logprob of prompt token t + 1 (the same convention as sampled
tokens, ``radixrelay.worker.sampling``: log-softmax of the raw model logits, natural log, fp32).
An extend that owes prompt logprobs asks for logits on a trailing run of its rows: the owed
positions, then (on the chunk that samples) the last row. Only the small results leave the device:
per position the prompt token's logprob and the top-k alternatives.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixrelay.worker.protocol import ExtendItem, PromptLogprobsChunk, TokenLogprobs


def num_logits_rows(item: ExtendItem) -> int:
    """Trailing rows of ``item``'s chunk that need logits: its prompt-logprobs positions, then its
    sampling row. Raises ``ValueError`` when the owed range is not such a trailing run."""
    if not item.num_prompt_logprobs:
        return int(item.sample)
    end = item.start + item.num_tokens
    first = item.prompt_logprobs_start
    if first < item.start or first + item.num_prompt_logprobs != end - item.sample:
        raise ValueError(f"request {item.rid}: prompt logprobs [{first}, {first + item.num_prompt_logprobs}) "
                         f"do not end the chunk [{item.start}, {end}) (sample={item.sample})")
    return end - first


def prompt_logprobs_chunk(item: ExtendItem, logits: torch.Tensor, token_ids: Sequence[int],
                          k: int) -> PromptLogprobsChunk:
    """``logits``: [num_prompt_logprobs, V], the rows of positions [first, first + n);
    ``token_ids``: the request's tokens (the prompt tokens first + 1 .. first + n are the targets)."""
    first, n = item.prompt_logprobs_start, item.num_prompt_logprobs
    logprobs = logits.float().log_softmax(dim=-1)                                  # [n, V] natural log
    targets = torch.tensor(token_ids[first + 1:first + n + 1], dtype=torch.int64)
    targets = targets.to(logits.device, non_blocking=True)                         # [n]
    chosen = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)                # [n]
    top = logprobs.topk(k, dim=-1)                                                 # [n, k], best first
    entries = [TokenLogprobs(value, list(zip(ids, values))) for value, ids, values
               in zip(chosen.tolist(), top.indices.tolist(), top.values.tolist())]
    return PromptLogprobsChunk(item.rid, first + 1, entries)
