"""Steps with extend rows (mixed prefill + decode, or prefill only) as piecewise CUDA graphs.

Everything but attention is captured, per token bucket; attention runs eagerly between the pieces on
the step's real rows, so one set of graphs serves any mix of extends, decodes, cascade plans and
prompt-logprobs rows (attention is the only op whose work depends on more than the token count).
For a model of L layers, a step of T tokens padded to the bucket T_b >= T runs

    piece 0:    cos, sin = rotary(positions); x = embed(ids); q = layer 0 before_attention(x)
    attention:  o[:T] = backend.forward(q[:T], 0, kv_cache, batch)            (eager, real rows)
    piece l:    h, x = model.next_layer_input(l-1, x, o); q = layer l before_attention(x, normed=h)   1 <= l < L
    attention:  o[:T] = backend.forward(q[:T], l, kv_cache, batch)
    piece L:    _, x = model.next_layer_input(L-1, x, o)
    logits = model.logits(x[batch.logits_indices])                             (eager, [R, V])

which is ``model(ids, batch, kv_cache, backend)`` op for op, over T_b rows instead of T. Every op in
the pieces is row-wise (embedding, RoPE, RMSNorm, the projections, the MLP, the K/V store), so padded
rows never change a real row: they carry token 0 at position 0, write their K/V to ``scratch_slot``
(a slot no request owns) and their attention output is whatever ``o`` last held; nothing reads it
for a real row. Only the GEMMs see a different M (T_b instead of T): on the GPU, cuBLAS may pick
another kernel for it, so results can differ from the eager model in the last bits (tests bound it
by the dtype; against the same pieces run eagerly the captured graphs are bit-identical).

Memory. Buffers: one set sized for the largest bucket; bucket T_b's graphs use its first T_b rows
(steps run one at a time). Per token of the largest bucket: ids, positions, out_slots (int64, 24 B),
cos and sin (float32, 4 * head_dim B), x, q, o (model dtype, (hidden + 2 * Hq * D) * elt B): ~25 KB
for Llama-3-8B in bf16, 55 MiB at 2304 tokens. Graphs: one pool shared by every piece of every bucket,
captured largest first so that the smaller buckets reuse its blocks: it holds the peak of one piece's
temporaries at the largest bucket (the MLP's, with RMSNorm's float32 copies), linear in the largest
bucket, plus a little per graph (its size for Llama-3-8B shapes with the default buckets:
benchmarks/results/HISTORY.md). The KV cache must leave that room (the worker sizes it from free memory).
Host per step: L + 1 replays, L eager attention calls and a copy each, 6 small copies of the inputs.

On the CPU (or with ``use_graphs=False``) the same pieces run eagerly over the same padded buffers:
the padding and piece boundaries are tested there.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from radixrelay.attention import AttentionBackend, ForwardBatch, KVCache
from radixrelay.model.llama import LlamaForCausalLM
from radixrelay.protocol.stats import WorkerCounters

logger = logging.getLogger("radixrelay.worker")


def token_buckets(max_tokens: int, sizes: list[int] | tuple[int, ...] | None = None) -> list[int]:
    """Padded step sizes: ``sizes`` below ``max_tokens`` (the worker's most tokens per step: chunked
    prefill budget + max running requests), then ``max_tokens`` itself. Default sizes: 16, 32, 64, 128,
    then eighths of each power of two from 256 (256, 288, ..., 480, 512, 576, ...): below ~256 rows the
    GEMMs are bound by reading the weights, so padding is nearly free; above, it costs its share of
    device time, kept under 1/8. Memory does not grow with the number of buckets (module docstring)."""
    if max_tokens < 1:
        raise ValueError(f"token_buckets: max_tokens must be >= 1, got {max_tokens}")
    if sizes is None:
        sizes, base = [16, 32, 64, 128], 256
        while base < max_tokens:
            sizes += range(base, 2 * base, base // 8)
            base *= 2
    return sorted({s for s in sizes if s < max_tokens} | {max_tokens})


@dataclass(frozen=True)
class CaptureReport:
    buckets: tuple[int, ...]     # captured (ascending)
    skipped: tuple[int, ...]     # not captured: the time or memory budget ran out first
    graphs: int                  # CUDA graphs captured (L + 1 per bucket)
    seconds: float
    memory_bytes: int            # device memory taken by the capture (graph pool), from mem_get_info


class PiecewiseGraphs:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, backend: AttentionBackend, *,
                 token_buckets: list[int] | tuple[int, ...], scratch_slot: int,
                 use_graphs: bool | None = None, counters: WorkerCounters | None = None) -> None:
        """``token_buckets``: padded step sizes (e.g. ``token_buckets(max_tokens)``); ``scratch_slot``:
        a KV slot outside every request's pages, written by padded rows; ``use_graphs``: capture CUDA
        graphs (default: on CUDA); ``counters``: the worker's, whose ``graph_captures`` count the buckets
        captured here (None: new ones). With graphs, a step runs only once ``capture_all()`` captured a bucket
        that holds it (``fits``); without, every bucket runs its pieces eagerly."""
        buckets = sorted(set(token_buckets))
        if not buckets or buckets[0] < 1:
            raise ValueError(f"PiecewiseGraphs: token_buckets must be positive, got {list(token_buckets)}")
        if not 0 <= scratch_slot < kv_cache.num_slots:
            raise ValueError(f"PiecewiseGraphs: scratch_slot {scratch_slot} outside the cache's "
                             f"{kv_cache.num_slots} slots")
        self.model, self.kv_cache, self.backend = model, kv_cache, backend
        self.buckets = buckets
        self.scratch_slot = scratch_slot
        self.device = kv_cache.device
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        if self.use_graphs and self.device.type != "cuda":
            raise ValueError("PiecewiseGraphs: use_graphs needs a CUDA KV cache")
        self.layers = list(model.model.layers)
        cfg = model.local_config                                              # this rank's heads
        n = buckets[-1]
        dtype = model.model.embed_tokens.weight.dtype
        i64 = dict(dtype=torch.int64, device=self.device)
        with torch.inference_mode():
            cos, _ = model.rotary(torch.zeros(1, **i64))                    # the rotary's dtype and width
        self._ids = torch.zeros(n, **i64)                                   # [N] token ids, pad 0
        self._positions = torch.zeros(n, **i64)                             # [N] pad 0
        self._out_slots = torch.full((n,), scratch_slot, **i64)             # [N] pad scratch_slot
        self._cos = torch.zeros(n, cos.shape[-1], dtype=cos.dtype, device=self.device)   # [N, D]
        self._sin = torch.zeros_like(self._cos)                                          # [N, D]
        self._x = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=self.device)       # [N, hidden]
        self._q = torch.zeros(n, cfg.num_heads, cfg.head_dim, dtype=dtype, device=self.device)  # [N, Hq, D]
        self._o = torch.zeros_like(self._q)                                              # [N, Hq, D]
        self._graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}           # bucket -> its L + 1 pieces
        self._ready = [] if self.use_graphs else list(buckets)             # buckets a step may use, ascending
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self._side: torch.cuda.Stream | None = None
        self.replays = 0       # steps run through the pieces (graph replays; eager pieces without graphs)
        self.captures = 0      # buckets captured (L + 1 graphs each); the worker's total: counters.graph_captures
        self.counters = counters if counters is not None else WorkerCounters()
        self.capture_s = 0.0   # host seconds spent capturing them (warm-up included)

    @property
    def max_tokens(self) -> int:
        """Largest step that runs here now (0 before ``capture_all`` with graphs)."""
        return self._ready[-1] if self._ready else 0

    def buffer_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self._ids, self._positions, self._out_slots,
                                                          self._cos, self._sin, self._x, self._q, self._o))

    def fits(self, batch: ForwardBatch) -> bool:
        return batch.num_tokens <= self.max_tokens

    @torch.inference_mode()
    def run(self, ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """ids: int64 [T] -> logits [R, V] for rows ``batch.logits_indices`` (float32; float64 for a
        float64 model), as ``model(ids, batch, kv_cache, backend)`` computes them. The logits are a new
        tensor (not a graph buffer): the next step may be launched before they are read."""
        num = batch.num_tokens
        if ids.shape[0] != num:
            raise ValueError(f"PiecewiseGraphs.run: {ids.shape[0]} input ids for a batch of {num} tokens")
        n = next((b for b in self._ready if b >= num), None)
        if n is None:
            raise ValueError(f"PiecewiseGraphs.run: {num} tokens exceed the largest ready bucket ({self.max_tokens})")
        self._fill(ids, batch, n)
        graphs = self._graphs.get(n)
        q, o = self._q[:num], self._o[:num]                                 # the real rows
        for i in range(len(self.layers) + 1):
            if i < len(self.layers):          # KV tier loads: before piece i, which stores layer i's new K/V
                self.kv_cache.wait_for_layer(self.layers[i].self_attn.layer_id)
            if graphs is None:
                self._piece(i, n)
            else:
                graphs[i].replay()
            if i < len(self.layers):
                self.backend.forward(q, self.layers[i].self_attn.layer_id, self.kv_cache, batch, out=o)
        self.replays += 1
        return self.model.logits(self._x[batch.logits_indices])

    def capture_all(self, *, max_seconds: float = 120.0, max_bytes: int | None = None) -> CaptureReport:
        """Capture every bucket, largest first (its pool blocks serve the smaller ones), until
        ``max_seconds`` or ``max_bytes`` (device memory taken so far) is exceeded; buckets left over
        are skipped (steps they would hold use the next larger captured bucket). Empties the CUDA caching
        allocator's cache at the end (start-up only). No-op without graphs."""
        if not self.use_graphs:
            return CaptureReport((), (), 0, 0.0, 0)
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        start = time.perf_counter()
        done, skipped = [], []
        self._reset_pads()
        for n in reversed(self.buckets):
            used = free_before - torch.cuda.mem_get_info(self.device)[0]
            if n in self._graphs:
                done.append(n)
            elif time.perf_counter() - start > max_seconds or (max_bytes is not None and used > max_bytes):
                skipped.append(n)
            else:
                self._capture(n)
                done.append(n)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()             # the warm-ups' cached blocks: what remains is the graphs' own
        report = CaptureReport(tuple(sorted(done)), tuple(sorted(skipped)), len(done) * (len(self.layers) + 1),
                               time.perf_counter() - start, free_before - torch.cuda.mem_get_info(self.device)[0])
        logger.info("piecewise CUDA graphs: %d buckets (%d graphs) up to %d tokens in %.1f s, %.0f MiB "
                    "(+ %.0f MiB buffers)%s", len(report.buckets), report.graphs, self.max_tokens, report.seconds,
                    report.memory_bytes / 2**20, self.buffer_bytes() / 2**20,
                    f"; skipped {list(report.skipped)} (budget)" if report.skipped else "")
        return report

    # -- internals ---------------------------------------------------------------------------------

    def _fill(self, ids: torch.Tensor, batch: ForwardBatch, n: int) -> None:
        """Real rows [0, T) from the step, padded rows [T, n) reset (a larger earlier step may have left
        real slots there)."""
        num = batch.num_tokens
        self._ids[:num].copy_(ids)
        self._positions[:num].copy_(batch.rope_positions)        # piece 0 only rotates by them
        self._out_slots[:num].copy_(batch.out_slots)
        if num < n:
            self._ids[num:n].zero_()
            self._positions[num:n].zero_()
            self._out_slots[num:n].fill_(self.scratch_slot)

    def _reset_pads(self) -> None:
        self._ids.zero_()
        self._positions.zero_()
        self._out_slots.fill_(self.scratch_slot)

    def _piece(self, i: int, n: int) -> None:
        """Piece ``i`` over the first ``n`` rows; reads and writes only the static buffers (and the KV
        cache at ``out_slots``), so that nothing allocated inside a graph outlives it."""
        x, cos, sin, slots = self._x[:n], self._cos[:n], self._sin[:n], self._out_slots[:n]
        h = None                                    # layer i's input norm, where layer i - 1 computed it
        if i == 0:
            c, s = self.model.rotary(self._positions[:n])                       # [n, D] each
            cos.copy_(c)
            sin.copy_(s)
            x.copy_(self.model.embed(self._ids[:n]))               # [n, hidden]
        else:
            h, out = self.model.next_layer_input(i - 1, x, self._o[:n])
            x.copy_(out)
        if i < len(self.layers):
            self._q[:n].copy_(self.layers[i].before_attention(x, cos, sin, slots, self.kv_cache, normed=h))

    @torch.inference_mode()
    def _capture(self, n: int) -> None:
        start = time.perf_counter()
        pieces = range(len(self.layers) + 1)
        stream = torch.cuda.current_stream(self.device)
        # One side stream for every warm-up and capture: the allocator caches blocks per stream and
        # cuBLAS keeps a workspace per stream (a fresh capture stream per graph would add one per graph).
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        side = self._side
        side.wait_stream(stream)
        with torch.cuda.stream(side):          # warm-up (library handles, workspaces); pads write scratch
            for i in pieces:
                self._piece(i, n)
        stream.wait_stream(side)
        graphs = []
        for i in pieces:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, stream=side):
                self._piece(i, n)
            graphs.append(graph)
        self._graphs[n] = graphs
        self._ready = sorted(self._graphs)
        self.captures += 1
        self.counters.graph_captures += 1
        self.capture_s += time.perf_counter() - start
