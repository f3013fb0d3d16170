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

from radixrelay.protocol.step import ExtendItem, PromptLogprobsChunk, TokenLogprobs
from radixrelay.worker.sampling import to_host


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
    return PendingPromptLogprobs.compute(item, logits, token_ids, k).to_host().chunk()


class PendingPromptLogprobs:
    """One chunk's prompt logprobs as tensors: computed on the device when the step launches,
    copied to the host without waiting (``to_host``), turned into the protocol value once the step's
    results are in (``chunk``)."""

    def __init__(self, rid: int, first: int, chosen: torch.Tensor, top_ids: torch.Tensor,
                 top_values: torch.Tensor) -> None:
        self.rid, self.first = rid, first
        self.chosen, self.top_ids, self.top_values = chosen, top_ids, top_values   # [n], [n, k], [n, k]

    @classmethod
    def compute(cls, item: ExtendItem, logits: torch.Tensor, token_ids: Sequence[int],
                k: int) -> PendingPromptLogprobs:
        first, n = item.prompt_logprobs_start, item.num_prompt_logprobs
        logprobs = logits.float().log_softmax(dim=-1)                              # [n, V] natural log
        targets = torch.tensor(token_ids[first + 1:first + n + 1], dtype=torch.int64)
        targets = targets.to(logits.device, non_blocking=True)                     # [n]
        chosen = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)            # [n]
        top = logprobs.topk(k, dim=-1)                                             # [n, k], best first
        return cls(item.rid, first, chosen, top.indices, top.values)

    def to_host(self) -> PendingPromptLogprobs:
        return PendingPromptLogprobs(self.rid, self.first, to_host(self.chosen), to_host(self.top_ids),
                                     to_host(self.top_values))

    def chunk(self) -> PromptLogprobsChunk:
        """Call once the copies of ``to_host`` are complete."""
        entries = [TokenLogprobs(value, list(zip(ids, values))) for value, ids, values
                   in zip(self.chosen.tolist(), self.top_ids.tolist(), self.top_values.tolist())]
        return PromptLogprobsChunk(self.rid, self.first + 1, entries)
