"""The KV pool in host memory: zero, writable, and free until used (an anonymous mapping the kernel
zeroes page by page on first touch, not a memset of the whole pool at start-up)."""

from __future__ import annotations

import torch

from radixrelay.attention import KVCache


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_a_large_host_pool_is_zero_and_takes_memory_only_where_written() -> None:
    before = _resident_bytes()
    # 1 GiB: 8 layers x K,V x 65,536 slots x 4 heads x 64 x 4 bytes / 2
    kv = KVCache(num_layers=8, num_pages=4096, page_size=16, num_kv_heads=4, head_dim=64,
                 dtype=torch.float32, device="cpu")
    assert kv.buffer.shape == (8, 2, 65536, 4, 64) and kv.buffer.is_contiguous()
    assert _resident_bytes() - before < 64 << 20, "allocating the pool touched its memory"
    kv.k[3][100:116] = 1.5
    kv.v[7][-1] = -2.0
    assert float(kv.buffer[3, 0, 100:116].sum()) == 1.5 * 16 * 4 * 64
    assert float(kv.buffer[7, 1, -1].sum()) == -2.0 * 4 * 64
    assert float(kv.k[0][:4096].abs().sum()) == 0.0 and float(kv.v[5][30000:34096].abs().sum()) == 0.0
    assert _resident_bytes() - before < 128 << 20


def test_pools_of_other_dtypes_are_zero() -> None:
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        kv = KVCache(num_layers=2, num_pages=3, page_size=4, num_kv_heads=2, head_dim=8, dtype=dtype,
                     device="cpu", model_dtype=torch.float32 if dtype != torch.bfloat16 else None)
        assert kv.buffer.dtype == dtype and kv.buffer.shape == (2, 2, 12, 2, 8)
        assert float(kv.buffer.float().abs().sum()) == 0.0
        kv.k[1][5] = 1.0
        assert float(kv.buffer.float().sum()) == 16.0
