"""The paged KV cache's own operations on the CPU."""

from __future__ import annotations

import pytest
import torch

from radixrelay.attention.kv_cache import KVCache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_copy_page_prefixes_copies_the_leading_slots_of_every_layer(dtype):
    cache = KVCache(num_layers=3, num_pages=6, page_size=4, num_kv_heads=2, head_dim=8, dtype=dtype, device="cpu")
    values = torch.randn(cache.buffer.shape).clamp(-8, 8)
    cache.buffer.copy_(values.to(dtype))
    before = cache.buffer.float().clone()
    cache.copy_page_prefixes([(1, 4, 3), (2, 5, 1)])
    after = cache.buffer.float()
    expected = before.clone()
    expected[:, :, 16:19] = before[:, :, 4:7]       # page 1's slots 0-2 -> page 4's
    expected[:, :, 20:21] = before[:, :, 8:9]       # page 2's slot 0 -> page 5's
    assert torch.equal(after, expected)
    cache.copy_page_prefixes([])
    assert torch.equal(cache.buffer.float(), expected)
