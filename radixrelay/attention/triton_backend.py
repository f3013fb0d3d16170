"""Attention through the Triton kernels (``radixrelay.kernels``); same contract as ``TorchBackend``.

A step's flat batch is extend rows first, then ``batch.num_decodes`` decode rows (one token each):

- extend rows: ``extend_attention`` over ``[kv_start, position]``; with prefill cascade
  (``batch.cascade.prefill``) each shared run is attended once by ``shared_node_attention`` for all the
  new tokens of its requests and merged into their rows in place by LSE, one ``merge_into_rows`` launch
  (RelayAttention's prompt phase);
- decode rows: ``paged_decode_attention`` over ``[0, seq_len)``, or with ``batch.cascade.decode``
  ``cascade_decode_attention`` (shared levels + own suffix ``[kv_start, seq_len)`` + one merge), planned
  once per step with ``plan_cascade``; with ``node_kernel="fa3"`` its nodes of consecutive pages go through
  FlashAttention-3 (``kernels/fa3_node.py``) where the cache is 16-bit in the queries' dtype.

Runs on the CPU under ``TRITON_INTERPRET=1`` (tests, tiny shapes). fp16 / bf16 / fp32 only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixrelay.attention.backend import AttentionBackend, LayerAttention
from radixrelay.attention.kv_cache import KVCache
from radixrelay.attention.metadata import ForwardBatch, SharedRuns
from radixrelay.kernels import CascadePlan, plan_cascade
from radixrelay.kernels._common import KernelLaunch
from radixrelay.kernels.cascade_decode import CascadeDecode, CascadeHost
from radixrelay.kernels.extend import Extend
from radixrelay.kernels.fa3_node import fa3_cache_usable
from radixrelay.kernels.merge import bind_merge_into_rows
from radixrelay.kernels.paged_decode import PagedDecode
from radixrelay.kernels.shared_node import SharedNode, tma_capable


@dataclass
class _Step:
    num_extend_tokens: int
    kv_start: torch.Tensor              # int32 [B]
    decode_plan: CascadePlan | None     # cascaded decode rows, else flat
    keep: bool = True                   # later layers reuse ``layers`` (not for bound steps: see ``bind``)
    layers: _Layers | None = None       # built by the step's first layer
    lse: torch.Tensor | None = None     # float32 [T, Hq]: the LSE ``forward(out=...)`` does not return


class TritonBackend(AttentionBackend):
    def __init__(self, sm_scale: float | None = None, *, overlap: bool = True, node_kernel: str = "triton") -> None:
        """``overlap``: on CUDA, run the shared levels on a side stream beside the own-KV decode;
        ``node_kernel``: "triton" or "fa3" (resolved and checked: ``fa3_node.resolve_node_kernel``)."""
        self.sm_scale = sm_scale
        self.overlap = overlap
        self.node_kernel = node_kernel
        self._side_stream: torch.cuda.Stream | None = None
        self._batch: ForwardBatch | None = None
        self._step: _Step | None = None

    def set_layers(self, layers) -> int | None:
        """The kernels compute plain causal attention only. Where every layer has one sliding window and
        nothing else differs (Mistral), attention within the window is plain attention: the context is
        capped at the window (returned). Anything else is refused."""
        layers: tuple[LayerAttention, ...] = tuple(layers)
        windows = {layer.window for layer in layers}
        if any(layer.logit_softcap is not None or layer.sm_scale is not None for layer in layers):
            raise ValueError("attention logit soft-capping and per-layer softmax scales (Gemma) need the torch "
                             "attention backend: not yet supported on cuda by the Triton kernels "
                             "(attention_backend='torch', or device='cpu')")
        if len(windows) > 1:
            raise ValueError("sliding-window layers beside full-attention or other-window layers (Gemma) need the "
                             "torch attention backend: not yet supported on cuda by the Triton kernels "
                             "(attention_backend='torch', or device='cpu')")
        self.layers = layers           # (the kernels read none of it: within the cap, every layer attends plainly)
        return windows.pop() if windows else None

    def bind(self, batch: ForwardBatch, kv_start: torch.Tensor, decode_plan: CascadePlan | None) -> None:
        """Use this per-step state for ``batch`` instead of planning it (CUDA graphs: a plan made
        outside the capture, over fixed buffers). ``batch`` must have no extend rows. Every layer then
        binds its own launches and buffers: one kept from a capture would outlive it, and its pool memory
        could be handed to a later capture's live tensors."""
        if batch.num_extends:
            raise ValueError("TritonBackend.bind: decode-only batches")
        self._batch, self._step = batch, _Step(0, kv_start, decode_plan, keep=False)

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
                host=CascadeHost(runs.host_rows, runs.host_indptr, runs.host_kv_lens, cascade.max_own_len),
                node_kernel=self.node_kernel_for(kv_cache))
        self._step = _Step(batch.num_tokens - batch.num_decodes, kv_start, decode_plan)
        self._batch = batch
        return self._step

    def forward_with_lse(
        self, q: torch.Tensor, layer_id: int, kv_cache: KVCache, batch: ForwardBatch,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``out``: optional (o [T, Hq, D] dtype of q, contiguous D; lse [T, Hq] float32) to write into."""
        step = self._step_for(batch, q, kv_cache)
        k, v = kv_cache.k[layer_id], kv_cache.v[layer_id]
        if out is None:
            o = torch.empty_like(q)                                              # [T, Hq, D]
            lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)  # [T, Hq]
        else:
            o, lse = out
        layers = step.layers
        if layers is None or not layers.fits(q, k, v, o, lse):
            layers = _Layers(self, batch, step, q, k, v, o, lse)                # checks, sizes, buffers, launches
            if step.keep:
                step.layers = layers
        layers(q, k, v, o, lse)
        return o, lse

    def forward(
        self, q: torch.Tensor, layer_id: int, kv_cache: KVCache, batch: ForwardBatch,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``out``: optional o [T, Hq, D] (dtype of q, contiguous D) to write into."""
        if out is None:
            return self.forward_with_lse(q, layer_id, kv_cache, batch)[0]
        step = self._step_for(batch, q, kv_cache)
        lse = step.lse                                                  # [T, Hq] scratch: nobody reads it
        if lse is None or lse.shape != q.shape[:2] or lse.device != q.device:
            lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
            if step.keep:
                step.lse = lse
        return self.forward_with_lse(q, layer_id, kv_cache, batch, out=(out, lse))[0]

    def node_kernel_for(self, kv_cache: KVCache) -> str:
        """FA3 only where asked and where it reads the cache as it is (16-bit, the queries' dtype)."""
        if (self.node_kernel == "fa3" and kv_cache.dtype == kv_cache.model_dtype
                and fa3_cache_usable(kv_cache.k[0], kv_cache.v[0])):
            return "fa3"
        return "triton"

    def splits_shared_pages(self, device: torch.device) -> bool:
        return tma_capable(torch.device(device))

    def splits_long_prefixes(self, device: torch.device) -> bool:
        return torch.device(device).type == "cuda"

    def _side(self, q: torch.Tensor) -> torch.cuda.Stream | None:
        if not (self.overlap and q.is_cuda):
            return None
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(q.device)
        return self._side_stream


def _layout(t: torch.Tensor) -> tuple:
    """What a bound launch assumes of a tensor besides its address: shape, strides, dtype, 16-byte alignment."""
    return t.shape, t.stride(), t.dtype, t.data_ptr() % 16 == 0


class _Layers:
    """A step's attention for every layer: built (checked, sized, buffered, bound) on the step's first layer
    from its tensors, then called per layer with tensors of the same layouts (``fits``)."""

    def __init__(self, backend: TritonBackend, batch: ForwardBatch, step: _Step, q, k, v, o, lse) -> None:
        self.layouts = tuple(_layout(t) for t in (q, k, v, o, lse))
        sm_scale = backend.sm_scale
        ext, first = step.num_extend_tokens, batch.num_extends
        self.ext = ext
        self.extend = self.prefill = self.decode = None
        self.merges: list[KernelLaunch] = []            # the prefill shared runs into the extend rows
        if ext:
            self.extend = Extend(q[:ext], k, v, batch.page_table[:first], batch.page_size, batch.q_indptr[:first + 1],
                                 step.kv_start[:first], batch.prefix_lens[:first], sm_scale,
                                 max_new_tokens=batch.max_q_len, out=(o[:ext], lse[:ext]))
            runs = None if batch.cascade is None else batch.cascade.prefill
            if runs is not None:
                # each extend token of a shared run has two parts: the run (shared) and its own window
                self.prefill = SharedNode(q, k, v, batch.page_size, runs.q_indptr, runs.q_rows, runs.kv_indptr,
                                          runs.kv_pages, runs.kv_lens, sm_scale, max_q_rows=runs.max_rows,
                                          max_kv_len=runs.max_kv_len, kv_contiguous=runs.contiguous)
                o_sh, lse_sh = self.prefill.out                               # [R, Hq, D], [R, Hq]
                merges = (bind_merge_into_rows(o, lse, runs.q_rows[a:b], o_sh[a:b], lse_sh[a:b])
                          for a, b in _merge_spans(runs))
                self.merges = [m for m in merges if m is not None]
        if batch.num_decodes == 0:
            return
        q_dec, out_dec = q[ext:], (o[ext:], lse[ext:])
        if step.decode_plan is None:
            self.decode = PagedDecode(q_dec, k, v, batch.page_table[first:], batch.page_size, step.kv_start[first:],
                                      batch.seq_lens[first:], sm_scale, max_kv_len=batch.max_seq_len, out=out_dec)
        else:
            self.decode = CascadeDecode(q_dec, k, v, step.decode_plan, sm_scale, backend._side(q), out=out_dec)

    def fits(self, q, k, v, o, lse) -> bool:
        return (_layout(q), _layout(k), _layout(v), _layout(o), _layout(lse)) == self.layouts

    def __call__(self, q, k, v, o, lse) -> None:
        ext = self.ext
        if self.extend is not None:
            self.extend(q, k, v, o, lse)                # rows [0, ext): same addresses as the full tensors
            if self.prefill is not None:
                self.prefill(q, k, v, *self.prefill.out)
                for merge in self.merges:               # the shared part into the extend rows of o, lse
                    merge(o_out=o, lse_out=lse)
        if self.decode is not None:
            if ext:
                q, o, lse = q[ext:], o[ext:], lse[ext:]
            self.decode(q, k, v, o, lse)


def _merge_spans(runs: SharedRuns) -> list[tuple[int, int]]:
    """Spans of ``runs.q_rows`` merged into the extend rows by one launch each: all of them at once where every
    row is distinct (as ``cascade.batch`` builds prefill runs: an extend reads at most one), else run by run,
    so that a row read by several runs gets their parts one after another (one run's rows are distinct)."""
    rows, indptr = runs.host_rows, runs.host_indptr
    if len(rows) != runs.q_rows.numel():                # no host copies: read them (one device sync)
        rows, indptr = tuple(runs.q_rows.tolist()), tuple(runs.q_indptr.tolist())
    if len(set(rows)) == len(rows):
        return [(0, len(rows))]
    spans = list(zip(indptr, indptr[1:]))
    if any(len(set(rows[a:b])) != b - a for a, b in spans):
        raise ValueError("prefill shared runs: a row appears twice in one run")
    return spans
