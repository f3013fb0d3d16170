"""Piecewise graphs: steps with extend rows through ``PiecewiseGraphs.run`` against ``model(...)``.

CPU (default): a tiny random Llama, ``TorchBackend``, the pieces run eagerly over the padded buffers.
The logits and every KV slot but the scratch slot agree with the eager model's to a few ulps for steps
of ``EXACT_FROM`` tokens or more: the same ops on the same rows (nothing mixes rows), and where the CPU
BLAS gives a row the same GEMM result at T and at the bucket's M (MKL on most CPUs) they are equal; on
some CPUs its fp64 kernels block M differently (seen: 1.3e-15 at T = 55 vs M = 64). Below that it
switches to GEMV / small-M kernels with another summation order, so a step of a few tokens (a lone
decode here) agrees to the dtype's rounding only (fp32 1e-5, fp64 1e-12, relative). The scratch slot is the only slot written
beside the step's own, and only when the bucket has padded rows.
GPU (``-m gpu``): bf16, ``TritonBackend``, captured graphs: bit-identical to the same pieces run
eagerly; within bf16 error of ``model(...)`` (padded GEMMs have another M, so cuBLAS may choose
another kernel).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

from radixrelay.attention import AttentionBackend, BatchRequest, ForwardBatch, KVCache, TorchBackend
from radixrelay.attention.metadata import SharedRun, build_forward_batch, build_shared_runs
from radixrelay.model import LlamaForCausalLM, ModelConfig, load_model
from radixrelay.worker.piecewise_graphs import CaptureReport, PiecewiseGraphs, token_buckets

CFG = ModelConfig(architecture="llama", vocab_size=256, hidden_size=64, intermediate_size=160, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=16)
PAGE = 4
NUM_PAGES = 96                      # handed to requests; one more page holds the scratch slot
SCRATCH = NUM_PAGES * PAGE
BUCKETS = [8, 16, 32, 64]
SENTINEL = 1234.0                   # scratch slot's initial K/V: any write changes it
EXACT_FROM = 16                     # tokens per step from which the CPU BLAS is row-independent (MKL)
RTOL = {torch.float32: 1e-5, torch.float64: 1e-12}


@pytest.fixture(autouse=True)
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclass
class _Request:
    tokens: list[int]
    pages: list[int]
    done: int                        # tokens already in the KV cache


@dataclass
class Requests:
    """Host bookkeeping of a scenario: prompts, scrambled page ids, cached prefixes shared by page."""

    vocab: int
    seed: int = 0
    reqs: dict[int, _Request] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.free = list(range(NUM_PAGES))
        self.rng.shuffle(self.free)

    def add(self, rid: int, prompt_len: int, *, share: tuple[int, int] | None = None) -> None:
        """``share``: (rid, pages) -- start with that request's first pages cached (a radix hit)."""
        pages, done = [], 0
        if share is not None:
            src, num = share
            pages, done = list(self.reqs[src].pages[:num]), num * PAGE
        self.reqs[rid] = _Request([self.rng.randrange(self.vocab) for _ in range(prompt_len)], pages, done)

    def step(self, extends: list[tuple[int, int, int]], decodes: list[int], device,
             cascade: bool = False) -> tuple[torch.Tensor, ForwardBatch]:
        """extends: (rid, new tokens, logits rows); decodes: rids whose prompt is done (one new token each).
        ``cascade``: the extends attend their common cached pages as one shared run."""
        work, ids = [], []
        for rid, n, logits in extends:
            work.append(self._take(rid, n, logits, ids))
        for rid in decodes:
            r = self.reqs[rid]
            r.tokens.append(self.rng.randrange(self.vocab))
            work.append(self._take(rid, 1, 1, ids))
        kv_start = prefill = None
        if cascade:
            first = [self.reqs[rid] for rid, _, _ in extends]
            shared = min(w.start for w in work[:len(extends)]) // PAGE
            assert shared > 0 and all(r.pages[:shared] == first[0].pages[:shared] for r in first)
            rows = list(range(sum(n for _, n, _ in extends)))
            prefill = build_shared_runs([SharedRun(rows, first[0].pages[:shared], shared * PAGE)], device)
            kv_start = [shared * PAGE] * len(extends) + [0] * len(decodes)
        batch = build_forward_batch(work, PAGE, device, num_decodes=len(decodes), kv_start=kv_start,
                                    prefill_runs=prefill)
        return torch.tensor(ids, dtype=torch.int64, device=device), batch

    def _take(self, rid: int, n: int, logits: int, ids: list[int]) -> BatchRequest:
        r = self.reqs[rid]
        if r.done + n > len(r.tokens):
            raise ValueError(f"request {rid}: {n} tokens past its {len(r.tokens)}")
        while len(r.pages) * PAGE < r.done + n:
            r.pages.append(self.free.pop())
        ids.extend(r.tokens[r.done:r.done + n])
        work = BatchRequest(list(r.pages), r.done, n, logits)
        r.done += n
        return work


Adds = list[tuple[int, int, tuple[int, int] | None]]      # (rid, prompt tokens, share) before a step


def scenario() -> list[tuple[Adds, list[tuple[int, int, int]], list[int]]]:
    """Six steps (new requests, extends, decodes); token counts 55, 31, 62, 35, 64, 1 over buckets
    8..64: padded, a smaller step in the bucket a larger one used (stale pad rows), a full bucket, one
    token; prompt logprobs rows, a chunked prompt, a cached prefix."""
    return [
        ([(0, 57, None), (1, 13, None), (2, 5, None)], [(0, 37, 1), (1, 13, 3), (2, 5, 1)], []),   # 55
        ([(3, 9, None)], [(0, 20, 1), (3, 9, 1)], [1, 2]),                                       # 31
        ([(4, 58, None)], [(4, 58, 1)], [0, 1, 2, 3]),                                           # 62
        ([(5, 12 + 18, (0, 3))], [(5, 18, 2)], [0, 1, 2, 3, 4]),         # 35: r0's first 3 pages cached
        ([(6, 59, None)], [(6, 59, 1)], [0, 1, 2, 3, 4]),                                        # 64
        ([], [], [5]),                                                                           # 1
    ]


def make_cache(dtype: torch.dtype, device) -> KVCache:
    return KVCache(num_layers=CFG.num_layers, num_pages=NUM_PAGES + 1, page_size=PAGE,
                   num_kv_heads=CFG.num_kv_heads, head_dim=CFG.head_dim, dtype=dtype, device=device)


def snapshot(kv: KVCache) -> list[torch.Tensor]:
    """K/V before a step (k then v per layer), the scratch slot first set to a value any write changes."""
    for t in kv.k + kv.v:
        t[SCRATCH].fill_(SENTINEL)
    return [t.clone() for t in kv.k + kv.v]


def written_slots(kv: KVCache, before: list[torch.Tensor]) -> set[int]:
    """Slots whose K or V differs from ``before`` (k then v per layer) in any layer."""
    changed = torch.zeros(kv.num_slots, dtype=torch.bool, device=kv.device)
    for now, old in zip(kv.k + kv.v, before):
        changed |= (now != old).flatten(1).any(1)
    return set(changed.nonzero().flatten().tolist())


def not_scratch(t: torch.Tensor) -> torch.Tensor:
    return torch.cat([t[:SCRATCH], t[SCRATCH + 1:]])


def check_writes(pw: PiecewiseGraphs, kv: KVCache, before: list[torch.Tensor], batch: ForwardBatch) -> None:
    """The step's own slots and, iff its bucket has padded rows, the scratch slot: nothing else."""
    bucket = next(b for b in pw.buckets if b >= batch.num_tokens)
    own = set(batch.out_slots.tolist())
    assert written_slots(kv, before) == own | ({SCRATCH} if batch.num_tokens < bucket else set())


def run_scenario(model: LlamaForCausalLM, backend: Callable[[], AttentionBackend], device, dtype,
                 use_graphs: bool | None = None, capture: bool = False):
    """Yield, per step: (batch, eager logits, piecewise logits, eager cache, piecewise cache, pw)."""
    eager_kv, pw_kv = make_cache(dtype, device), make_cache(dtype, device)
    pw = PiecewiseGraphs(model, pw_kv, backend(), token_buckets=BUCKETS, scratch_slot=SCRATCH, use_graphs=use_graphs)
    if capture:
        report = pw.capture_all()
        assert report.buckets == tuple(BUCKETS) and report.graphs == len(BUCKETS) * (CFG.num_layers + 1)
    eager_backend = backend()
    reqs = Requests(CFG.vocab_size)
    for adds, extends, decodes in scenario():
        for rid, n, share in adds:
            reqs.add(rid, n, share=share)
        ids, batch = reqs.step(extends, decodes, device)
        before = snapshot(pw_kv)
        want = model(ids, batch, eager_kv, eager_backend)
        got = pw.run(ids, batch)
        check_writes(pw, pw_kv, before, batch)
        yield batch, want, got, eager_kv, pw_kv, pw


def tiny_model(dtype: torch.dtype, device="cpu") -> LlamaForCausalLM:
    model, _ = load_model(CFG, dtype=dtype, device=device, seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(8.0 if p.dim() == 2 else 1.0)      # larger than the dummy std: sharper attention, O(1) logits
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_mixed_steps_exact_on_cpu(dtype):
    model = tiny_model(dtype)
    steps = 0
    for batch, want, got, eager_kv, pw_kv, pw in run_scenario(model, TorchBackend, "cpu", dtype):
        steps += 1
        assert got.shape == (batch.logits_indices.shape[0], CFG.vocab_size) and got.dtype == want.dtype
        pairs = [(got, want)] + [(not_scratch(b), not_scratch(a)) for a, b in
                                 zip(eager_kv.k + eager_kv.v, pw_kv.k + pw_kv.v)]
        for x, y in pairs:
            if batch.num_tokens >= EXACT_FROM:        # a few ulps at most (0 where the BLAS is row-independent)
                ulps = 16 * torch.finfo(dtype).eps * y.abs().max().item()
                torch.testing.assert_close(x, y, rtol=0, atol=ulps)
            else:
                torch.testing.assert_close(x, y, rtol=RTOL[dtype], atol=RTOL[dtype] * y.abs().max().item())
        assert want.abs().max() > 1.0                  # the logits are not all tiny
    assert steps == 6 and pw.replays == 6 and pw.captures == 0


def test_cascade_batch_passes_through():
    """Attention is eager on the step's own batch: a prefill cascade plan is used as is."""
    model = tiny_model(torch.float32)
    eager_kv, pw_kv = make_cache(torch.float32, "cpu"), make_cache(torch.float32, "cpu")
    pw = PiecewiseGraphs(model, pw_kv, TorchBackend(), token_buckets=BUCKETS, scratch_slot=SCRATCH)
    reqs = Requests(CFG.vocab_size, seed=3)
    reqs.add(0, 16)
    reqs.add(9, 3)
    ids, batch = reqs.step([(0, 16, 1), (9, 3, 1)], [], "cpu")
    assert torch.equal(pw.run(ids, batch), model(ids, batch, eager_kv, TorchBackend()))
    reqs.add(1, 12 + 11, share=(0, 3))                  # both start with r0's first 3 pages cached
    reqs.add(2, 12 + 7, share=(0, 3))
    ids, batch = reqs.step([(1, 11, 2), (2, 7, 1)], [9], "cpu", cascade=True)
    assert batch.cascade is not None and batch.cascade.prefill is not None
    before = snapshot(pw_kv)
    want = model(ids, batch, eager_kv, TorchBackend())
    assert torch.equal(pw.run(ids, batch), want)
    check_writes(pw, pw_kv, before, batch)


def test_fits_and_errors():
    model = tiny_model(torch.float32)
    kv = make_cache(torch.float32, "cpu")
    pw = PiecewiseGraphs(model, kv, TorchBackend(), token_buckets=[16, 8], scratch_slot=SCRATCH)
    assert pw.buckets == [8, 16] and pw.max_tokens == 16
    reqs = Requests(CFG.vocab_size)
    reqs.add(0, 40)
    ids, batch = reqs.step([(0, 17, 1)], [], "cpu")
    assert not pw.fits(batch)
    with pytest.raises(ValueError, match="largest ready bucket"):
        pw.run(ids, batch)
    ids, batch = reqs.step([(0, 16, 1)], [], "cpu")
    assert pw.fits(batch)
    with pytest.raises(ValueError, match="input ids"):
        pw.run(ids[:-1], batch)
    assert pw.capture_all() == CaptureReport((), (), 0, 0.0, 0)           # no graphs on the CPU
    with pytest.raises(ValueError, match="scratch_slot"):
        PiecewiseGraphs(model, kv, TorchBackend(), token_buckets=[8], scratch_slot=kv.num_slots)
    with pytest.raises(ValueError, match="positive"):
        PiecewiseGraphs(model, kv, TorchBackend(), token_buckets=[0, 8], scratch_slot=SCRATCH)
    with pytest.raises(ValueError, match="CUDA"):
        PiecewiseGraphs(model, kv, TorchBackend(), token_buckets=[8], scratch_slot=SCRATCH, use_graphs=True)


def test_token_buckets():
    eighths = list(range(256, 512, 32)) + list(range(512, 1024, 64)) + list(range(1024, 2048, 128))
    assert token_buckets(2048 + 256) == [16, 32, 64, 128] + eighths + [2048, 2304]
    assert token_buckets(4096)[-9:] == list(range(2048, 4096 + 1, 256))
    assert token_buckets(100) == [16, 32, 64, 100]
    assert token_buckets(8) == [8]
    assert token_buckets(100, [64, 16, 128]) == [16, 64, 100]
    buckets = token_buckets(8192)
    assert all(b / a <= 1.125 for a, b in zip(buckets, buckets[1:]) if a >= 256)    # padding under 1/8
    with pytest.raises(ValueError):
        token_buckets(0)


@pytest.mark.gpu
def test_captured_mixed_steps_on_cuda():
    from radixrelay.attention.factory import make_backend

    def triton():
        return make_backend("triton", "cuda")

    model = tiny_model(torch.bfloat16, "cuda")
    graphs = list(run_scenario(model, triton, "cuda", torch.bfloat16, capture=True))
    pieces = list(run_scenario(model, triton, "cuda", torch.bfloat16, use_graphs=False))
    assert graphs[-1][-1].replays == 6 and graphs[-1][-1].captures == len(BUCKETS)
    for (batch, want, got, eager_kv, pw_kv, _), (_, _, got_eager, _, pieces_kv, _) in zip(graphs, pieces):
        assert torch.equal(got, got_eager), batch.num_tokens                # capture changes nothing
        scale = want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * scale)
    for a, b, c in zip(eager_kv.k + eager_kv.v, pw_kv.k + pw_kv.v, pieces_kv.k + pieces_kv.v):
        assert torch.equal(not_scratch(b), not_scratch(c))
        torch.testing.assert_close(not_scratch(b), not_scratch(a), rtol=2e-2, atol=2e-2)
