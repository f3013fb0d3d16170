"""An FP8 KV cache (``--kv-cache-dtype fp8``: float8 e4m3, scale 1) through the Triton kernels under the
interpreter: the attention kernels read e4m3 K/V as the query's dtype (exact) and equal the float64
reference over the same cache; the fused RoPE + K/V store writes e4m3, clamped to the format's range.
The caches are filled by torch's cast; the kernel's own fp32 -> e4m3 rounding is checked on the GPU
(the interpreter rounds values just under a power of two down a binade), so the values it writes here lie
on the e4m3 grid already, or past its range."""

from __future__ import annotations

import pytest
import torch

import tests.kernels.test_extend as extend_tests
import tests.kernels.test_paged_decode as decode_tests
import tests.kernels.test_shared_node as node_tests
from radixrelay.kernels.rope_store import rope_and_store
from radixrelay.model.layers import rope_and_store_reference
from tests.kernels.helpers import DEVICE, make_cache

E4M3 = torch.float8_e4m3fn


def _fp8_cache(*args, **kwargs):
    k, v = make_cache(*args, **kwargs)
    return (k * 8).to(E4M3), (v * 8).to(E4M3)         # spread over the format's range, then rounded by torch


@pytest.fixture
def fp8_caches(monkeypatch):
    for module in (decode_tests, extend_tests, node_tests):
        monkeypatch.setattr(module, "make_cache", _fp8_cache)


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
def unit_fp8_caches(monkeypatch):
    """e4m3 caches of unit-scale values (P.V in bf16 stays within bf16's tolerance of the float64 reference)."""
    def unit_fp8_cache(*args, **kwargs):
        return tuple(c.to(E4M3) for c in make_cache(*args, **kwargs))

    for module in (decode_tests, extend_tests, node_tests):
        monkeypatch.setattr(module, "make_cache", unit_fp8_cache)


@pytest.mark.gpu
def test_fp8_cache_kernels_at_real_sizes_gpu(unit_fp8_caches):
    """On the GPU, bf16 queries at real sizes: every attention kernel over an e4m3 cache equals the float64
    reference over the same cache; the shared node by TMA (consecutive pages) and gathered, the cascade
    against flat decode."""
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
