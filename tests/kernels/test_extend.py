"""extend_attention against the float64 reference: ragged new tokens, cached prefixes of any length,
kv_start > 0 (prompt-phase cascade), GQA / MHA, several head dims."""

import pytest
import torch

from radixrelay.kernels import extend_attention, extend_attention_reference
from radixrelay.kernels import extend as extend_mod
from tests.kernels.helpers import (DEVICE, assert_close_attention, int32, make_cache, page_lists, page_table,
                                   poisoned)


def run_case(new_tokens, prefix_lens, kv_start, num_q_heads, num_kv_heads, head_dim, page_size, dtype, seed,
             **launch):
    gen = torch.Generator(DEVICE).manual_seed(seed)
    ends = [p + n for p, n in zip(prefix_lens, new_tokens)]
    num_pages = sum(-(-e // page_size) for e in ends) + 2
    k_cache, v_cache = make_cache(num_pages, page_size, num_kv_heads, head_dim, dtype, gen)
    table = page_table(page_lists(ends, page_size, num_pages, gen))
    q = torch.randn((sum(new_tokens), num_q_heads, head_dim), generator=gen, device=DEVICE).to(dtype)
    q_indptr = int32([0] + torch.tensor(new_tokens).cumsum(0).tolist())
    args = (q, k_cache, v_cache, table, page_size, q_indptr, int32(kv_start), int32(prefix_lens))
    out = poisoned(tuple(q.shape), dtype)
    if launch:   # drive the launcher directly to pin the tile sizes
        extend_mod._launch(*args, head_dim**-0.5, *out, num_q_heads // num_kv_heads, max(new_tokens), **launch)
        o, lse = out
    else:
        o, lse = extend_attention(*args, out=out)
    o_ref, lse_ref = extend_attention_reference(*args)
    assert_close_attention(o, lse, o_ref, lse_ref, dtype)


@pytest.mark.parametrize(
    "num_q_heads, num_kv_heads, head_dim, page_size",
    [(8, 2, 64, 16), (4, 4, 32, 3), (6, 2, 128, 8)],    # GQA 4, MHA, GQA 3
)
def test_extend_ragged(num_q_heads, num_kv_heads, head_dim, page_size):
    # no prefix, a long prefix, no new tokens, one new token, a shared front left out (kv_start > 0)
    new_tokens = [37, 20, 0, 1, 30]
    prefix_lens = [0, 45, 10, 19, 24]
    kv_start = [0, 0, 0, 0, 16]
    run_case(new_tokens, prefix_lens, kv_start, num_q_heads, num_kv_heads, head_dim, page_size, torch.float32,
             seed=head_dim)


def test_extend_small_tiles_and_rows_before_kv_start():
    # kv_start beyond the first new positions: those tokens attend nothing (lse = -inf, o = 0)
    run_case([40, 9], [8, 0], [20, 3], 4, 2, 32, 4, torch.float32, seed=11,
             block_m=16, block_n=16, num_warps=4, num_stages=1)


def test_extend_rejects_bad_arguments():
    q = torch.zeros((3, 4, 32), device=DEVICE)
    k = torch.zeros((16, 2, 32), device=DEVICE)
    with pytest.raises(ValueError, match="prefix_lens must have 1"):
        extend_attention(q, k, k, int32([[0, 1]]), 8, int32([0, 3]), int32([0]), int32([0, 0]))
    with pytest.raises(ValueError, match="num_slots"):
        extend_attention(q, k, k, int32([[0, 1]]), 5, int32([0, 3]), int32([0]), int32([0]))


@pytest.mark.gpu
@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_dim", [(32, 8, 128), (8, 8, 64)])
def test_extend_real_size_gpu(num_q_heads, num_kv_heads, head_dim):
    run_case([1000, 2048, 1, 333], [4096, 0, 3000, 517], [0, 0, 1024, 0], num_q_heads, num_kv_heads, head_dim, 16,
             torch.bfloat16, seed=12)


@pytest.mark.parametrize("dtype, head_dim, tiles", [(torch.float32, 128, (64, 64)), (torch.bfloat16, 128, (128, 128)),
                                                    (torch.float32, 64, (128, 128))])
def test_tiles_fit_shared_memory(dtype, head_dim, tiles):
    """fp32 with a 128-wide head takes 64 x 64 tiles: 128 x 128 need 256 KB of shared memory (an H100
    block has 227 KB), so every fp32 extend of a Llama-3-8B-shaped model failed to compile."""
    q = torch.zeros(200, 4, head_dim, dtype=dtype)
    cache = torch.zeros(64, 2, head_dim, dtype=dtype)
    one = torch.zeros(1, dtype=torch.int32)
    launch = extend_mod.bind(q, cache, cache, torch.zeros(1, 4, dtype=torch.int32), 16, torch.tensor([0, 200], dtype=torch.int32),
                             one, one, 1.0, torch.zeros_like(q), torch.zeros(200, 4), group=2, max_new_tokens=200)
    names = list(launch._index)
    assert (launch.args[names.index("BLOCK_M")], launch.args[names.index("BLOCK_N")]) == tiles
