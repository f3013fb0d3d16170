"""Attention through the Triton kernels (``radixrelay.kernels``); same contract as ``TorchBackend``.

A step's flat batch is extend rows first, then ``batch.num_decodes`` decode rows (one token each):

- extend rows: ``extend_attention`` over ``[kv_start, position]``; with prefill cascade
  (``batch.cascade.prefill``) each shared run is attended once by ``shared_node_attention`` for all the
  new tokens of its requests and merged in by LSE (RelayAttention's prompt phase);
- decode rows: ``paged_decode_attention`` over ``[0, seq_len)``, or with ``batch.cascade.decode``
  ``cascade_decode_attention`` (shared levels + own suffix ``[kv_start, seq_len)`` + one merge), planned
  once per step with ``plan_cascade``.

Runs on the CPU under ``TRITON_INTERPRET=1`` (tests, tiny shapes). fp16 / bf16 / fp32 only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixrelay.attention.backend import AttentionBackend
from radixrelay.attention.kv_cache import KVCache
from radixrelay.attention.metadata import ForwardBatch, SharedRuns
from radixrelay.attention.reference import merge_states
from radixrelay.kernels import (CascadePlan, cascade_decode_attention, extend_attention, paged_decode_attention,
                                plan_cascade, shared_node_attention)
from radixrelay.kernels.cascade import CascadeHost
from radixrelay.kernels.shared_node import tma_capable


@dataclass(frozen=True)
class _Step:
    num_extend_tokens: int
    kv_start: torch.Tensor              # int32 [B]
    decode_plan: CascadePlan | None     # cascaded decode rows, else flat


class TritonBackend(AttentionBackend):
    def __init__(self, sm_scale: float | None = None, *, overlap: bool = True) -> None:
        """``overlap``: on CUDA, run the shared levels on a side stream beside the own-KV decode."""
        self.sm_scale = sm_scale
        self.overlap = overlap
        self._side_stream: torch.cuda.Stream | None = None
        self._batch: ForwardBatch | None = None
        self._step: _Step | None = None

    def bind(self, batch: ForwardBatch, kv_start: torch.Tensor, decode_plan: CascadePlan | None) -> None:
        """Use this per-step state for ``batch`` instead of planning it (CUDA graphs: a plan made
        outside the capture, over fixed buffers). ``batch`` must have no extend rows."""
        if batch.num_extends:
            raise ValueError("TritonBackend.bind: decode-only batches")
        self._batch, self._step = batch, _Step(0, kv_start, decode_plan)

    def _step_for(self, batch: ForwardBatch, q: torch.Tensor, kv_cache: KVCache) -> _Step:
        if batch is self._batch and self._step is not None:
            return self._step
        cascade = batch.cascade
        kv_start = (torch.zeros(batch.num_requests, dtype=torch.int32, device=q.device) if cascade is None
                    else cascade.kv_start)
        decode_plan = None
        if cascade is not None and cascade.decode is not None:
            first = batch.num_extends
            runs = cascade.decode
            decode_plan = plan_cascade(
                runs.q_indptr, runs.q_rows, runs.kv_indptr, runs.kv_pages, runs.kv_lens,
                batch.page_table[first:], kv_start[first:], batch.seq_lens[first:],
                num_q_heads=q.shape[1], num_kv_heads=kv_cache.k[0].shape[1], head_dim=q.shape[2],
                page_size=batch.page_size, kv_contiguous=runs.contiguous,
                host=CascadeHost(runs.host_rows, runs.host_indptr, runs.host_kv_lens, cascade.max_own_len))
        self._step = _Step(batch.num_tokens - batch.num_decodes, kv_start, decode_plan)
        self._batch = batch
        return self._step

    def forward_with_lse(
        self, q: torch.Tensor, layer_id: int, kv_cache: KVCache, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        step = self._step_for(batch, q, kv_cache)
        k, v = kv_cache.k[layer_id], kv_cache.v[layer_id]
        o = torch.empty_like(q)                                              # [T, Hq, D]
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)  # [T, Hq]
        ext, first = step.num_extend_tokens, batch.num_extends
        if ext:
            extend_attention(q[:ext], k, v, batch.page_table[:first], batch.page_size,
                             batch.q_indptr[:first + 1], step.kv_start[:first], batch.prefix_lens[:first],
                             self.sm_scale, max_new_tokens=batch.max_q_len, out=(o[:ext], lse[:ext]))
            if batch.cascade is not None and batch.cascade.prefill is not None:
                self._merge_prefill(q, k, v, batch.page_size, batch.cascade.prefill, o, lse)
        if batch.num_decodes == 0:
            return o, lse
        if step.decode_plan is None:
            paged_decode_attention(q[ext:], k, v, batch.page_table[first:], batch.page_size, step.kv_start[first:],
                                   batch.seq_lens[first:], self.sm_scale, max_kv_len=batch.max_seq_len,
                                   out=(o[ext:], lse[ext:]))
        else:
            o_dec, lse_dec = cascade_decode_attention(q[ext:], k, v, step.decode_plan, self.sm_scale,
                                                      side_stream=self._side(q))
            o[ext:], lse[ext:] = o_dec, lse_dec
        return o, lse

    def forward(
        self, q: torch.Tensor, layer_id: int, kv_cache: KVCache, batch: ForwardBatch
    ) -> torch.Tensor:
        return self.forward_with_lse(q, layer_id, kv_cache, batch)[0]

    def splits_shared_pages(self, device: torch.device) -> bool:
        return tma_capable(torch.device(device))

    def splits_long_prefixes(self, device: torch.device) -> bool:
        return torch.device(device).type == "cuda"

    def _merge_prefill(self, q, k, v, page_size: int, runs: SharedRuns, o, lse) -> None:
        """Each extend token of a shared run has two parts: the run (shared) and its own window."""
        o_sh, lse_sh = shared_node_attention(q, k, v, page_size, runs.q_indptr, runs.q_rows, runs.kv_indptr,
                                             runs.kv_pages, runs.kv_lens, self.sm_scale,
                                             max_q_rows=runs.max_rows, max_kv_len=runs.max_kv_len,
                                             kv_contiguous=runs.contiguous)
        rows = runs.q_rows.long()
        o[rows], lse[rows] = merge_states(o[rows], lse[rows], o_sh, lse_sh)

    def _side(self, q: torch.Tensor) -> torch.cuda.Stream | None:
        if not (self.overlap and q.is_cuda):
            return None
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(q.device)
        return self._side_stream

