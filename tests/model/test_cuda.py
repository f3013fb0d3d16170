"""CUDA runs (``-m gpu``): the reference backend and the model in bf16/fp16 on the GPU."""

from __future__ import annotations

import copy

import pytest
import torch

from radixrelay.attention import (
    BatchRequest,
    KVCache,
    TorchBackend,
    build_forward_batch,
    extend_reference,
)
from radixrelay.model import ModelConfig, load_model

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float16, 5e-3)])
def test_reference_attention_on_cuda(dtype, tol):
    gen = torch.Generator().manual_seed(0)
    page, hkv, hq, d = 16, 2, 8, 64
    k = torch.randn(64 * page, hkv, d, generator=gen)
    v = torch.randn(64 * page, hkv, d, generator=gen)
    reqs = [BatchRequest(list(range(40, 30, -1)), 100, 37), BatchRequest([3, 9, 1], 40, 1)]
    q = torch.randn(38, hq, d, generator=gen)
    cpu = build_forward_batch(reqs, page, "cpu")
    gpu = build_forward_batch(reqs, page, "cuda")
    o, lse = extend_reference(q.cuda().to(dtype), k.cuda().to(dtype), v.cuda().to(dtype),
                              gpu.page_table, page, gpu.q_indptr, gpu.prefix_lens)
    assert o.dtype == dtype and lse.dtype == torch.float32
    # Inputs were rounded to dtype, so compare against float64 of the same rounded inputs.
    o_ref, lse_ref = extend_reference(q.to(dtype).double(), k.to(dtype).double(), v.to(dtype).double(),
                                      cpu.page_table, page, cpu.q_indptr, cpu.prefix_lens)
    torch.testing.assert_close(lse.cpu().double(), lse_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(o.cpu().double(), o_ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_model_on_cuda_agrees_with_cpu_fp32(dtype):
    """Same dummy weights: a CUDA half-precision step through the paged cache vs CPU float32."""
    cfg = ModelConfig(architecture="llama", vocab_size=512, hidden_size=256, intermediate_size=512,
                      num_layers=4, num_heads=8, num_kv_heads=2, head_dim=32)
    model_cpu, _ = load_model(cfg, seed=0)
    with torch.no_grad():
        for p in model_cpu.parameters():
            p.mul_(4.0 if p.dim() == 2 else 1.0)  # scale up the small dummy weights: sharper attention
    model = copy.deepcopy(model_cpu).to("cuda", dtype)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in (45, 8)]
    reqs = [BatchRequest([9, 3, 11, 0], 0, 45), BatchRequest([4, 7], 0, 8)]

    def logits(net, device, dtype):
        cache = KVCache(num_layers=cfg.num_layers, num_pages=12, page_size=16, num_kv_heads=cfg.num_kv_heads,
                        head_dim=cfg.head_dim, dtype=dtype, device=device)
        batch = build_forward_batch(reqs, 16, device)
        ids = torch.tensor(seqs[0] + seqs[1], device=device)
        return net(ids, batch, cache, TorchBackend()).cpu()

    ref = logits(model_cpu, "cpu", torch.float32)
    got = logits(model, "cuda", dtype)
    assert got.dtype == torch.float32 and got.shape == (2, cfg.vocab_size)
    assert (torch.nn.functional.cosine_similarity(got, ref, dim=-1) > 0.999).all()
