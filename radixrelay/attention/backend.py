"""Attention backend interface and the pure-torch implementation.

Contract, per model step:
1. the model writes each layer's new K/V into ``kv_cache`` at ``batch.out_slots`` (``KVCache.store``);
2. it calls ``backend.forward(q, layer_id, kv_cache, batch)`` which returns ``o: [T, Hq, D]``,
   each new token attending its request's cached prefix plus the new tokens up to itself.
   With ``batch.cascade`` the same result is computed in parts: every shared run of KV once for its
   group of rows, each request's ``[kv_start, seq_len)`` on its own, merged by LSE (exact).

Per-step preparation (index plans, kernel workspaces) depends only on the batch, not the layer:
backends build it on the first layer call for a batch and reuse it for the others.

Layers that attend differently (``LayerAttention``: a sliding window, logit soft-capping, a softmax
scale other than ``head_dim ** -0.5``; Gemma, Mistral) are told to the backend once, by the model
(``set_layers``); a backend that cannot compute them refuses there, at load.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from radixrelay.attention.kv_cache import KVCache
from radixrelay.attention.metadata import ForwardBatch, SharedRuns
from radixrelay.attention.reference import AttentionPlan, attend_planned, plan_attention


@dataclass(frozen=True)
class LayerAttention:
    """How one layer attends, where it differs from plain causal attention."""

    window: int | None = None           # attends the last ``window`` positions, itself included
    logit_softcap: float | None = None  # scores s -> cap * tanh(s / cap), after scaling (Gemma 2)
    sm_scale: float | None = None       # None: head_dim ** -0.5

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise ValueError(f"LayerAttention.window: must be >= 1, got {self.window}")
        if self.logit_softcap is not None and not self.logit_softcap > 0:
            raise ValueError(f"LayerAttention.logit_softcap: must be > 0, got {self.logit_softcap}")

    @property
    def plain(self) -> bool:
        return self == PLAIN


PLAIN = LayerAttention()


class AttentionBackend(ABC):
    layers: tuple[LayerAttention, ...] = ()      # per layer id (``set_layers``); beyond it: plain

    def set_layers(self, layers: Sequence[LayerAttention]) -> int | None:
        """How each layer attends (index: layer id). Returns the longest context this backend computes
        exactly for them (None: any); ``ValueError`` where it cannot compute them. This base accepts
        only plain layers."""
        layers = tuple(layers)
        if any(not layer.plain for layer in layers):
            raise ValueError(f"{type(self).__name__}: sliding-window, soft-capped or rescaled attention layers "
                             "are not supported")
        self.layers = layers
        return None

    def layer(self, layer_id: int) -> LayerAttention:
        return self.layers[layer_id] if layer_id < len(self.layers) else PLAIN

    @abstractmethod
    def forward(
        self, q: torch.Tensor, layer_id: int, kv_cache: KVCache, batch: ForwardBatch,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [T, Hq, D] -> o: [T, Hq, D] in q's dtype; the new tokens' K/V are already cached.
        ``out``: a tensor like o to write the result into (and return)."""

    def forward_with_lse(
        self, q: torch.Tensor, layer_id: int, kv_cache: KVCache, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Like ``forward`` but also returns ``lse: [T, Hq]`` float32, natural log."""
        raise NotImplementedError(f"{type(self).__name__} does not return the LSE")

    def splits_long_prefixes(self, device: torch.device) -> bool:
        """Whether a short extend's long cached prefix should be read as a shared run of its own
        (``cascade.batch.long_prefix_runs``): only where shared runs are split along their length."""
        return False

    def splits_shared_pages(self, device: torch.device) -> bool:
        """Whether shared runs should be split at page-id breaks (``cascade.batch.split_at_page_breaks``):
        only worth it where consecutive pages load faster than gathered ones."""
        return False

    def node_kernel_for(self, kv_cache) -> str:
        """The kernel of shared decode nodes over ``kv_cache`` ("triton" or "fa3"; planned into the decode
        graphs' launch shapes)."""
        return "triton"


@dataclass(frozen=True)
class _SharedPart:
    plan: AttentionPlan     # groups as requests: rows attend positions [0, kv_len) of the group's run
    rows: torch.Tensor      # int64 [R] flat token row of each of the plan's query rows


@dataclass(frozen=True)
class _StepPlan:
    own: AttentionPlan
    shared: tuple[_SharedPart, ...]
    windowed: dict = field(default_factory=dict)     # window -> the flat plan of that sliding window


class TorchBackend(AttentionBackend):
    """Reference backend: batched torch ops over a padded gather (see ``reference.py``)."""

    def splits_long_prefixes(self, device: torch.device) -> bool:
        """On the CPU a short extend's long cached prefix is read as a shared run: gathered once and attended
        without a mask (``AttentionPlan.mask`` None), its own few tokens with a small causal mask."""
        return torch.device(device).type == "cpu"

    def __init__(self, sm_scale: float | None = None) -> None:
        self.sm_scale = sm_scale
        self._batch: ForwardBatch | None = None
        self._plan: _StepPlan | None = None

    def _plan_for(self, batch: ForwardBatch) -> _StepPlan:
        if batch is not self._batch or self._plan is None:
            cascade = batch.cascade
            # With a cascade, requests read only their own windows [kv_start, position]: sized by the longest
            # window (read off the tensors), not the longest sequence, so a long prefix read as a shared run
            # is not gathered again per request.
            own = plan_attention(
                batch.page_table, batch.page_size, batch.q_indptr, batch.prefix_lens,
                None if cascade is None else cascade.kv_start,
                max_q_len=batch.max_q_len, max_kv_len=batch.max_seq_len if cascade is None else None,
                num_tokens=batch.num_tokens,
            )
            shared = []
            if cascade is not None and cascade.prefill is not None:
                shared.append(_shared_part(cascade.prefill, batch.page_size, 0))
            if cascade is not None and cascade.decode is not None:
                first_decode_row = batch.num_tokens - batch.num_decodes
                shared.append(_shared_part(cascade.decode, batch.page_size, first_decode_row))
            self._plan = _StepPlan(own, tuple(shared))
            self._batch = batch
        return self._plan

    def set_layers(self, layers: Sequence[LayerAttention]) -> int | None:
        """Every kind of layer: windows as masks over a flat plan (a windowed layer does not use the step's
        cascade: its shared runs would need each query's window), soft-capping and scales in the scores."""
        self.layers = tuple(layers)
        return None

    def _windowed(self, batch: ForwardBatch, window: int) -> AttentionPlan:
        """The step's flat plan for a sliding window: each request's KV from the first position its first
        new token sees (``prefix_len - window + 1``) to its end."""
        plans = self._plan_for(batch).windowed
        if window not in plans:
            kv_start = (batch.prefix_lens.long() - (window - 1)).clamp(min=0)
            plans[window] = plan_attention(
                batch.page_table, batch.page_size, batch.q_indptr, batch.prefix_lens, kv_start,
                max_q_len=batch.max_q_len, max_kv_len=min(batch.max_seq_len, batch.max_q_len + window - 1),
                num_tokens=batch.num_tokens, window=window)
        return plans[window]

    def _scale(self, spec: LayerAttention) -> float | None:
        return self.sm_scale if spec.sm_scale is None else spec.sm_scale

    def forward_with_lse(
        self, q: torch.Tensor, layer_id: int, kv_cache: KVCache, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        spec = self.layer(layer_id)
        plan = self._plan_for(batch)
        k, v = kv_cache.k[layer_id], kv_cache.v[layer_id]
        scale, cap = self._scale(spec), spec.logit_softcap
        if spec.window is not None:
            return attend_planned(q, k, v, self._windowed(batch, spec.window), scale, softcap=cap)
        o, lse = attend_planned(q, k, v, plan.own, scale, softcap=cap)
        if not plan.shared:
            return o, lse
        parts = [(o, lse, torch.arange(q.shape[0], device=q.device))]
        for part in plan.shared:
            parts.append((*attend_planned(q[part.rows], k, v, part.plan, scale, softcap=cap), part.rows))
        return merge_rows(parts, q.shape[0])

    def forward(
        self, q: torch.Tensor, layer_id: int, kv_cache: KVCache, batch: ForwardBatch,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        spec = self.layer(layer_id)
        plan = self._plan_for(batch)
        if plan.shared and spec.window is None:
            o = self.forward_with_lse(q, layer_id, kv_cache, batch)[0]
        else:       # flat batch: the same computation, without the LSE's fix-up and scatter
            flat = plan.own if spec.window is None else self._windowed(batch, spec.window)
            o = attend_planned(q, kv_cache.k[layer_id], kv_cache.v[layer_id], flat, self._scale(spec),
                               with_lse=False, softcap=spec.logit_softcap)[0]
        return o if out is None else out.copy_(o)


def _shared_part(runs: SharedRuns, page_size: int, row_offset: int) -> _SharedPart:
    """Each group is one 'request' whose rows sit past its run (so the causal mask allows all of it)."""
    pages = torch.arange(max(runs.max_pages, 1), device=runs.kv_pages.device)
    index = (runs.kv_indptr[:-1, None].long() + pages).clamp(max=runs.kv_pages.shape[0] - 1)
    page_table = runs.kv_pages[index]                                   # [G, max_pages], padded
    plan = plan_attention(page_table, page_size, runs.q_indptr, runs.kv_lens, kv_end=runs.kv_lens,
                          max_q_len=runs.max_rows, max_kv_len=runs.max_kv_len,
                          num_tokens=runs.q_rows.shape[0])
    return _SharedPart(plan, runs.q_rows.long() + row_offset)


def merge_rows(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
               num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial states by LSE: each part is (o [P, H, D], lse [P, H], rows int64 [P]) and row
    ``rows[p]`` of the result merges every part row aimed at it. Empty parts (lse = -inf) drop out;
    a row with no non-empty part gets (0, -inf). Accumulates in lse's dtype."""
    o_all = torch.cat([p[0] for p in parts])
    lse_all = torch.cat([p[1] for p in parts])
    dest = torch.cat([p[2] for p in parts])
    heads, head_dim = o_all.shape[1:]
    m = lse_all.new_full((num_rows, heads), float("-inf"))
    m = m.scatter_reduce(0, dest[:, None].expand(-1, heads), lse_all, reduce="amax")
    m = torch.where(m.isinf(), 0.0, m)
    w = torch.exp(lse_all - m[dest])                                   # [P, H], 0 for empty parts
    total = lse_all.new_zeros((num_rows, heads)).index_add_(0, dest, w)
    weighted = torch.where(w[..., None] > 0, o_all.to(w.dtype) * w[..., None], 0.0)
    acc = w.new_zeros((num_rows, heads, head_dim)).index_add_(0, dest, weighted)
    o = acc / torch.where(total == 0, 1.0, total)[..., None]
    return o.to(o_all.dtype), m + torch.log(total)
