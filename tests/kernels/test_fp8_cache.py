"""An FP8 KV cache (``--kv-cache-dtype fp8``: float8 e4m3, scale 1) through the Triton kernels under the
interpreter: the attention kernels round each query row to e4m3 at its own scale, run Q.K^T on e4m3 and P.V in
the query's dtype (V read exactly), and equal the float64 reference over the same cache with the same rounding;
the fused RoPE + K/V store writes e4m3, clamped to the format's range.
The caches are filled by torch's cast and the queries lie on the e4m3 grid at a power-of-two row scale: the
kernels' own fp32 -> e4m3 rounding is checked on the GPU (the interpreter rounds values just under a power of
two down a binade), so the values they round here lie on the e4m3 grid already, or past its range."""

from __future__ import annotations

import pytest
import torch

import tests.kernels.test_extend as extend_tests
import tests.kernels.test_paged_decode as decode_tests
import tests.kernels.test_shared_node as node_tests
from radixrelay.kernels.rope_store import rope_and_store, rope_and_store_reference
from radixrelay.kernels._common import quantize_query_rows_reference
from radixrelay.kernels.fp8_quant import quantize_rows_reference
from tests.kernels.helpers import DEVICE, make_cache, make_query

E4M3 = torch.float8_e4m3fn


def _fp8_cache(*args, **kwargs):
    k, v = make_cache(*args, **kwargs)
    return (k * 8).to(E4M3), (v * 8).to(E4M3)         # spread over the format's range, then rounded by torch


def _grid_query(shape, dtype, gen, nudge: float = 2.0**-6):
    """Queries whose rows round onto e4m3 values with a largest magnitude of 448, times 2^-6 (the row scale, a
    power of two): each value but the largest is ``nudge`` of itself off the grid (less than half a step, never
    up to a power of two), so a kernel that does not round its queries misses the reference."""
    x = (make_query(shape, torch.float32, gen) * 60).clamp(-440, 440).to(E4M3).float() * (1 + nudge)
    x[..., 0] = torch.where(x[..., 0] < 0, -448.0, 448.0)
    return (x * 2.0**-6).to(dtype)


@pytest.fixture
def fp8_caches(monkeypatch):
    for module in (decode_tests, extend_tests, node_tests):
        monkeypatch.setattr(module, "make_cache", _fp8_cache)
        monkeypatch.setattr(module, "make_query", _grid_query)


def test_query_rows_round_as_the_per_row_quantization():
    """The kernels' query rounding in torch: each (token, head) row at its own scale, as ``quantize_rows``
    (which divides by the scale where this multiplies by its reciprocal: the same but for a rare last-bit tie,
    one e4m3 step at most); a zero row stays zero; on-grid rows are kept as they are."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 16, generator=gen) * torch.tensor([1e-3, 1.0, 300.0])[:, None, None]
    q[1, 2] = 0
    got = quantize_query_rows_reference(q)
    values, scale = quantize_rows_reference(q.reshape(12, 16))
    divided = (values.double() * scale.double()).reshape(3, 4, 16)
    assert got.dtype == torch.float64
    assert (got != divided).float().mean() < 0.01
    torch.testing.assert_close(got, divided, rtol=2**-3, atol=0)
    assert torch.all(got[1, 2] == 0) and not torch.equal(got, q.double())
    nudged = _grid_query((2, 3, 16), torch.float32, torch.Generator().manual_seed(1))
    grid = _grid_query((2, 3, 16), torch.float32, torch.Generator().manual_seed(1), nudge=0)
    assert not torch.equal(nudged, grid)
    assert torch.equal(quantize_query_rows_reference(nudged), grid.double())
    assert torch.equal(quantize_query_rows_reference(grid), grid.double())


def test_paged_decode_reads_an_fp8_cache(fp8_caches):
    decode_tests.run_case([0, 9, 0, 3], [150, 9, 1, 37], 8, 2, 64, 16, torch.float32, seed=1)


def test_extend_reads_an_fp8_cache(fp8_caches):
    extend_tests.run_case([37, 20, 1], [0, 45, 19], [0, 0, 0], 8, 2, 64, 16, torch.float32, seed=2)


def test_shared_node_reads_an_fp8_cache(fp8_caches):
    node_tests.run_case(7, [[0, 1, 2, 3, 4, 5, 6], [1, 3, 5], [4]], [70, 32, 1], 8, 2, 64, 16, torch.float32, seed=3)


def test_cascade_over_an_fp8_cache_equals_flat(fp8_caches):
    node_tests.run_cascade(6, 40, [5, 17, 1, 30, 2, 9], 8, 2, 64, 16, torch.float32, seed=4)


def test_rope_and_store_writes_e4m3_clamped():
    hq, hkv, d, t = 4, 2, 32, 3
    gen = torch.Generator().manual_seed(5)
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=gen) * 40).to(E4M3).float().to(DEVICE)   # on the grid
    qkv[0, hq * d] = 1000.0                                 # a K value past e4m3's range: stored as 448
    qkv[1, (hq + hkv) * d + 3] = -2000.0                    # a V value: -448
    cos = torch.ones(t, d, device=DEVICE)                   # position 0: the rotation is the identity
    sin = torch.zeros(t, d, device=DEVICE)
    slots = torch.tensor([3, 0, 6], dtype=torch.int64, device=DEVICE)
    caches = [torch.zeros(8, hkv, d, dtype=E4M3, device=DEVICE) for _ in range(4)]
    q = rope_and_store(qkv, cos, sin, slots, caches[0], caches[1], hq, hkv)
    q_ref = rope_and_store_reference(qkv, cos, sin, slots, caches[2], caches[3], hq, hkv)
    torch.testing.assert_close(q, q_ref)
    assert torch.equal(caches[0].float(), caches[2].float()) and torch.equal(caches[1].float(), caches[3].float())
    assert caches[0][3, 0, 0].float() == 448 and caches[1][0, 0, 3].float() == -448
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        rope_and_store(qkv, cos, sin, slots, caches[0].half(), caches[1].half(), hq, hkv)


@pytest.fixture
def fp8_caches_random_queries(monkeypatch):
    """e4m3 caches of unit-scale values (P.V in bf16 stays within bf16's tolerance of the float64 reference)
    and random bf16 queries."""
    def unit_fp8_cache(*args, **kwargs):
        return tuple(c.to(E4M3) for c in make_cache(*args, **kwargs))

    for module in (decode_tests, extend_tests, node_tests):
        monkeypatch.setattr(module, "make_cache", unit_fp8_cache)


@pytest.mark.gpu
def test_fp8_cache_kernels_round_queries_as_the_reference_gpu(fp8_caches_random_queries):
    """On FP8 tensor cores, bf16 queries at real sizes: every attention kernel over an e4m3 cache equals the
    float64 reference with the queries rounded per row (the kernels' own fp32 -> e4m3 rounding and scales);
    the shared node by TMA (consecutive pages) and gathered, the cascade against flat decode."""
    group_rows = [list(range(256)), list(range(0, 256, 3)), [7], [3, 9]]
    for contiguous in (True, False):
        node_tests.run_case(256, group_rows, [8192 + 40, 1000, 0, 1], 32, 8, 128, 16, torch.bfloat16, seed=21,
                            contiguous=contiguous)
    ends = torch.randint(1, 5000, (64,), generator=torch.Generator().manual_seed(22)).tolist()
    decode_tests.run_case([0 if i % 3 else min(e, 700) for i, e in enumerate(ends)], ends, 32, 8, 128, 16,
                          torch.bfloat16, seed=23)
    extend_tests.run_case([1000, 2048, 1, 333], [4096, 0, 3000, 517], [0, 0, 1024, 0], 32, 8, 128, 16,
                          torch.bfloat16, seed=24)
    suffixes = torch.randint(0, 600, (128,), generator=torch.Generator().manual_seed(25)).tolist()
    node_tests.run_cascade(128, 8192, suffixes, 32, 8, 128, 16, torch.bfloat16, seed=26)
