"""Attention backend interface and the pure-torch implementation.

Contract, per model step:
1. the model writes each layer's new K/V into ``kv_cache`` at ``batch.out_slots`` (``KVCache.store``);
2. it calls ``backend.forward(q, layer_id, kv_cache, batch)`` which returns ``o: [T, Hq, D]``,
   each new token attending its request's cached prefix plus the new tokens up to itself.

Per-step preparation (index plans, kernel workspaces) depends only on the batch, not the layer:
backends build it on the first layer call for a batch and reuse it for the others.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from radixrelay.attention.kv_cache import KVCache
from radixrelay.attention.metadata import ForwardBatch
from radixrelay.attention.reference import AttentionPlan, attend_planned, plan_attention


class AttentionBackend(ABC):
    @abstractmethod
    def forward(
        self, q: torch.Tensor, layer_id: int, kv_cache: KVCache, batch: ForwardBatch
    ) -> torch.Tensor:
        """q: [T, Hq, D] -> o: [T, Hq, D] in q's dtype; the new tokens' K/V are already cached."""

    def forward_with_lse(
        self, q: torch.Tensor, layer_id: int, kv_cache: KVCache, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Like ``forward`` but also returns ``lse: [T, Hq]`` float32, natural log."""
        raise NotImplementedError(f"{type(self).__name__} does not return the LSE")


class TorchBackend(AttentionBackend):
    """Reference backend: batched torch ops over a padded gather (see ``reference.py``)."""

    def __init__(self, sm_scale: float | None = None) -> None:
        self.sm_scale = sm_scale
        self._batch: ForwardBatch | None = None
        self._plan: AttentionPlan | None = None

    def _plan_for(self, batch: ForwardBatch) -> AttentionPlan:
        if batch is not self._batch or self._plan is None:
            self._plan = plan_attention(
                batch.page_table, batch.page_size, batch.q_indptr, batch.prefix_lens,
                max_q_len=batch.max_q_len, max_kv_len=batch.max_seq_len,
                num_tokens=batch.num_tokens,
            )
            self._batch = batch
        return self._plan

    def forward_with_lse(
        self, q: torch.Tensor, layer_id: int, kv_cache: KVCache, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        plan = self._plan_for(batch)
        return attend_planned(q, kv_cache.k[layer_id], kv_cache.v[layer_id], plan, self.sm_scale)

    def forward(
        self, q: torch.Tensor, layer_id: int, kv_cache: KVCache, batch: ForwardBatch
    ) -> torch.Tensor:
        return self.forward_with_lse(q, layer_id, kv_cache, batch)[0]
