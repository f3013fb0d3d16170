"""FP8 on the GPU (``-m gpu``, FP8 tensor cores: H100): the FP8 linear layer through ``torch._scaled_mm``
against its CPU emulation, inside a CUDA graph too, the split-K product of few rows against cuBLAS's, a model
quantized at load against the emulated one, and the quantization fused into RMSNorm and SiLU-and-mul against
the products' own."""

from __future__ import annotations

import pytest
import torch

from radixrelay.model import ModelConfig, load_model
from radixrelay.model.quantization import Fp8Linear, Precision

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs FP8 tensor cores")]


@pytest.mark.parametrize("rows", [1, 7, 256])
def test_fp8_linear_on_cuda_equals_its_emulation(rows):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(384, 256, generator=gen) * 0.05
    x = torch.randn(rows, 256, generator=gen)
    emulated = Fp8Linear(256, 384, emulate=True)
    emulated.load_rows(0, w)
    cuda = Fp8Linear(256, 384, dtype=torch.bfloat16, device="cuda")
    cuda.load_rows(0, w.cuda())
    assert torch.equal(cuda.weight.float().cpu(), emulated.weight) and torch.equal(cuda.weight_scale.cpu(), emulated.weight_scale)
    want = emulated(x.bfloat16().float())
    got = cuda(x.cuda().bfloat16())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float().cpu(), want, rtol=2e-2, atol=2e-2)      # bf16 output rounding
    graph, static = torch.cuda.CUDAGraph(), x.cuda().bfloat16()
    with torch.cuda.graph(graph):
        out = cuda(static)
    graph.replay()
    assert torch.equal(out, got)


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("k, n", [(4096, 4096), (14336, 4096)])
def test_split_k_product_equals_scaled_mm_on_cuda(rows, k, n):
    """Few rows through the 8B model's ``o`` and ``down`` shapes: the split-K product (what ``Fp8Linear``
    runs there on Hopper) equals cuBLAS's FP8 product to fp32 summation order, inside a CUDA graph too."""
    from radixrelay.kernels.fp8_gemm import fp8_split_k, split_k_capable
    from radixrelay.kernels.fp8_quant import quantize_rows

    if not split_k_capable(torch.device("cuda")):
        pytest.skip("the split-K product runs on Hopper")
    gen = torch.Generator(device="cuda").manual_seed(rows + k)
    layer = Fp8Linear(k, n, dtype=torch.bfloat16, device="cuda")
    layer.load_rows(0, torch.randn(n, k, generator=gen, device="cuda") * 0.02)
    x = torch.randn(rows, k, generator=gen, device="cuda").bfloat16()
    q_x, s_x = quantize_rows(x)
    want = torch._scaled_mm(q_x, layer.weight.t(), scale_a=s_x, scale_b=layer.weight_scale[None, :],
                            out_dtype=torch.bfloat16).float()
    got = fp8_split_k(q_x, s_x, layer.weight, layer.weight_scale, torch.bfloat16).float()
    assert ((got - want).norm() / want.norm()).item() < 5e-3                   # bf16 rounding of either
    assert layer.split_k(rows) and not layer.split_k(256)
    torch.testing.assert_close(layer(x).float(), got, rtol=0, atol=0)          # the layer takes this path
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x)
    graph.replay()
    assert torch.equal(out.float(), got)


@pytest.mark.parametrize("cols", [4096, 14336])
def test_quantize_rows_kernel_equals_the_torch_ops_on_cuda(cols):
    from radixrelay.kernels.fp8_quant import quantize_rows, quantize_rows_reference

    gen = torch.Generator(device="cuda").manual_seed(cols)
    x = (torch.randn(300, cols, generator=gen, device="cuda") * torch.logspace(-3, 3, 300, device="cuda")[:, None])
    x = x.bfloat16()
    x[7] = 0
    q, scale = quantize_rows(x)
    q_ref, scale_ref = quantize_rows_reference(x)
    assert torch.equal(scale, scale_ref) and torch.equal(q.float(), q_ref.float())


def test_model_in_fp8_on_cuda_tracks_its_emulation_and_bf16():
    """Same dummy weights (same device, same seed): FP8 on the tensor cores against the emulation of the same
    quantization (in bf16 on the GPU) and against the unquantized bf16 model."""
    from radixrelay.attention import BatchRequest, KVCache, TorchBackend, build_forward_batch

    cfg = ModelConfig(architecture="llama", vocab_size=512, hidden_size=256, intermediate_size=512,
                      num_layers=2, num_heads=8, num_kv_heads=2, head_dim=32)

    def logits(precision):
        net, _ = load_model(cfg, device="cuda", seed=0, precision=precision)
        cache = KVCache(num_layers=2, num_pages=4, page_size=16, num_kv_heads=2, head_dim=32,
                        dtype=torch.bfloat16, device="cuda")
        batch = build_forward_batch([BatchRequest([2, 0, 3], 0, 40)], 16, "cuda")
        ids = torch.arange(40, device="cuda") * 7 % cfg.vocab_size
        return net(ids, batch, cache, TorchBackend()).float().cpu()

    fp8, emulated, bf16 = (logits(p) for p in (Precision(weights="fp8"), Precision(weights="fp8", emulate=True),
                                                Precision()))
    assert torch.isfinite(fp8).all()
    assert (torch.nn.functional.cosine_similarity(fp8, emulated, dim=-1) > 0.999).all()
    assert (fp8.softmax(-1) - bf16.softmax(-1)).abs().sum(-1).max() < 0.1
    # the last layer kept in bf16 (fp8_keep_layers): against its emulation, and nearer bf16 than all-FP8
    kept, kept_emulated = (logits(Precision(weights="fp8", emulate=e, keep_layers=(-1,))) for e in (False, True))
    assert (torch.nn.functional.cosine_similarity(kept, kept_emulated, dim=-1) > 0.999).all()
    assert (kept - bf16).norm() < (fp8 - bf16).norm()


def test_fp8_kv_cache_serves_with_cascade_equal_to_flat_and_close_to_bf16(tmp_path):
    """An FP8 KV cache on the GPU: half the bytes per page, every serving step a graph replay, no compile after
    ready; cascade over it gives flat's greedy tokens (same e4m3 values, the merge exact to rounding); and
    the tokens stay close to the bf16 cache's."""
    from radixrelay import Engine, SamplingParams
    from tests.engine.test_engine_gpu import _prompts, greedy_close, make_tiny_model_dir

    model_dir = make_tiny_model_dir(tmp_path)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=2)

    def run(kv: str, cascade: str):
        with Engine(model=str(model_dir), load_format="dummy", device="cuda", cascade=cascade,
                    kv_cache_tokens=65536, kv_cache_dtype=kv, host_kv_gib=0.5) as engine:
            engine.generate(_prompts()[:1], params)
            before = engine.stats()
            outs = engine.generate(_prompts(), params)
            return outs, engine.stats(), before

    with Engine(model=str(model_dir), load_format="dummy", device="cuda", kv_cache_tokens=65536,
                quantization="fp8") as engine:                     # FP8 weights: graphs, no compile after ready
        engine.generate(_prompts()[:1], params)
        before = engine.stats()
        fp8_weights = engine.generate(_prompts(), params)
        after = engine.stats()
    assert after["eager_steps"] == before["eager_steps"] and after["jit_after_ready"] == 0
    assert all(len(o.token_ids) == 32 for o in fp8_weights)
    flat, _, _ = run("fp8", "off")
    cascaded, stats, before = run("fp8", "on")
    bf16, _, _ = run("auto", "off")
    assert greedy_close(flat, cascaded, "fp8 cascade") >= 8 * len(flat)
    assert stats["cascade_steps"] > 0 and stats["eager_steps"] == before["eager_steps"]
    assert stats["jit_after_ready"] == 0
    same_first = sum(a.token_ids[0] == b.token_ids[0] for a, b in zip(bf16, flat))
    assert same_first >= 0.75 * len(flat)          # e4m3 K/V: close to bf16, not equal


@pytest.mark.parametrize("hidden,inter", [(4096, 14336), (96, 1100)])
def test_fused_quantization_kernels_equal_quantize_rows_on_cuda(hidden, inter):
    """RMSNorm (with and without its residual add) and SiLU-and-mul with the quantization fused: the scales of
    the unfused kernel followed by ``quantize_rows``, compiled, and its e4m3 bytes but for a rare neighbouring
    code (the fp32 reduction's order)."""
    from radixrelay.kernels.fp8_quant import quantize_rows
    from radixrelay.kernels.rms_norm import rms_norm
    from radixrelay.kernels.silu_mul import silu_mul

    def same(got, y):
        # compiled, the fused variant may sum a row's squares in another order than the kernel writing y:
        # a last-bit change of the row's 1/rms can move a value of y by one bf16 step, and then its e4m3
        # code by one; everything else is equal
        q, scale = quantize_rows(y)
        assert got.dtype == y.dtype and torch.equal(got.scale, scale)
        a, b = got.q.view(torch.uint8).int(), q.view(torch.uint8).int()
        moved = a != b
        assert moved.float().mean() < 1e-3 and bool(((a - b).abs()[moved] == 1).all())

    gen = torch.Generator(device="cuda").manual_seed(hidden)
    spread = torch.logspace(-3, 3, 300, device="cuda")[:, None]
    x = (torch.randn(300, hidden, generator=gen, device="cuda") * spread).bfloat16()
    r = torch.randn(300, hidden, generator=gen, device="cuda").bfloat16()
    w = torch.randn(hidden, generator=gen, device="cuda").bfloat16()
    x[7], r[7] = 0, 0
    same(rms_norm(x, w, 1e-5, quantize=True), rms_norm(x, w, 1e-5))
    (got, s), (y, s_ref) = rms_norm(x, w, 1e-5, residual=r, quantize=True), rms_norm(x, w, 1e-5, residual=r)
    same(got, y)
    assert torch.equal(s, s_ref)
    gate_up = (torch.randn(300, 2 * inter, generator=gen, device="cuda") * spread).bfloat16()
    gate_up[7] = 0
    same(silu_mul(gate_up, quantize=True), silu_mul(gate_up))


def test_fused_quantization_in_the_model_on_cuda_gives_the_products_own_logits():
    """A tiny FP8 model: the norms and SiLU-and-mul quantizing for the products, or every product quantizing
    its own input: the same logits bit for bit (prefill and decode), eagerly and replayed from a CUDA graph."""
    from radixrelay.attention import BatchRequest, KVCache, TorchBackend, build_forward_batch

    cfg = ModelConfig(architecture="llama", vocab_size=512, hidden_size=256, intermediate_size=512,
                      num_layers=2, num_heads=8, num_kv_heads=2, head_dim=32)
    net, _ = load_model(cfg, device="cuda", seed=0, precision=Precision(weights="fp8"))
    assert all(layer.input_layernorm.quantize_output and layer.mlp.quantized_down for layer in net.model.layers)
    ids = torch.arange(41, device="cuda") * 7 % cfg.vocab_size
    backend = TorchBackend()

    def logits():
        cache = KVCache(num_layers=2, num_pages=4, page_size=16, num_kv_heads=2, head_dim=32,
                        dtype=torch.bfloat16, device="cuda")
        prefill = net(ids[:40], build_forward_batch([BatchRequest([2, 0, 3], 0, 40)], 16, "cuda"), cache, backend)
        decode_batch = build_forward_batch([BatchRequest([2, 0, 3], 40, 1)], 16, "cuda")
        decode = net(ids[40:], decode_batch, cache, backend)
        return prefill, decode, cache, decode_batch

    fused_prefill, fused_decode, cache, decode_batch = logits()
    graph = torch.cuda.CUDAGraph()              # the decode again (its K/V rewritten alike), captured
    with torch.cuda.graph(graph):
        replayed = net(ids[40:], decode_batch, cache, backend)
    graph.replay()
    for layer in net.model.layers:
        layer.quantize_into_products(False)
    own_prefill, own_decode, _, _ = logits()
    assert torch.isfinite(own_prefill).all()
    assert torch.equal(fused_prefill, own_prefill) and torch.equal(fused_decode, own_decode)
    assert torch.equal(replayed, fused_decode)
