"""paged_decode_attention against the float64 reference: ragged ranges, empty ranges, page boundaries,
GQA / MHA, several head dims, with and without KV splits."""

import pytest
import torch

from radixrelay.kernels import paged_decode_attention, paged_decode_attention_reference
from radixrelay.kernels import paged_decode as decode_mod
from radixrelay.kernels.cascade_decode import OWN_BESIDE, OWN_BESIDE_LIGHT
from tests.kernels.helpers import (DEVICE, assert_close_attention, int32, make_cache, page_lists, page_table,
                                   poisoned)


def run_case(starts, ends, num_q_heads, num_kv_heads, head_dim, page_size, dtype, seed, **launch):
    """Build a random paged batch, run the kernel on poisoned outputs, compare with the reference."""
    gen = torch.Generator(DEVICE).manual_seed(seed)
    num_pages = sum(-(-e // page_size) for e in ends) + 3
    k_cache, v_cache = make_cache(num_pages, page_size, num_kv_heads, head_dim, dtype, gen)
    table = page_table(page_lists(ends, page_size, num_pages, gen))
    batch = len(ends)
    q = torch.randn((batch, num_q_heads, head_dim), generator=gen, device=DEVICE).to(dtype)
    kv_start, kv_end = int32(starts), int32(ends)
    out = poisoned(tuple(q.shape), dtype)
    if launch:   # drive the launcher directly to pin the split count / tiles
        group = num_q_heads // num_kv_heads
        decode_mod._launch(q, k_cache, v_cache, table, page_size, kv_start, kv_end, head_dim**-0.5, *out, group,
                           max(ends), **launch)
        o, lse = out
    else:
        o, lse = paged_decode_attention(q, k_cache, v_cache, table, page_size, kv_start, kv_end, out=out)
    o_ref, lse_ref = paged_decode_attention_reference(q, k_cache, v_cache, table, page_size, kv_start, kv_end)
    assert_close_attention(o, lse, o_ref, lse_ref, dtype)


@pytest.mark.parametrize(
    "num_q_heads, num_kv_heads, head_dim, page_size",
    [(8, 2, 64, 16), (4, 4, 32, 1), (6, 2, 128, 5)],   # GQA 4, MHA, GQA 3 with odd pages
)
def test_decode_ragged_batch(num_q_heads, num_kv_heads, head_dim, page_size):
    # ranges: long, empty, one token, starting mid-page, crossing pages, exactly one page
    starts = [0, 9, 0, 7, 3, 0]
    ends = [150, 9, 1, 100, 37, page_size]
    run_case(starts, ends, num_q_heads, num_kv_heads, head_dim, page_size, torch.float32, seed=head_dim)


@pytest.mark.parametrize("options", [OWN_BESIDE_LIGHT, {k: v for k, v in OWN_BESIDE.items() if k != "maxnreg"}],
                         ids=["beside light", "beside"])
def test_decode_cascade_launch_options(options):
    """The tiles the cascade launches the own KV with (beside the shared nodes): ranges shorter than, equal to
    and longer than a tile, starting mid-page."""
    run_case([0, 3, 17, 0], [31, 35, 200, 64], 8, 2, 64, 16, torch.float32, seed=21, **options)


@pytest.mark.parametrize("slots_per_sm", [1, 64])    # many splits, then a single split
def test_decode_split_counts(slots_per_sm):
    run_case([0, 5, 40], [300, 200, 40], 4, 2, 32, 8, torch.float32, seed=slots_per_sm,
             block_n=16, slots_per_sm=slots_per_sm, overhead=0)


def test_decode_rejects_bad_arguments():
    q = torch.zeros((2, 4, 32), device=DEVICE)
    k = torch.zeros((16, 2, 32), device=DEVICE)
    table, ranges = int32([[0], [1]]), int32([0, 0])
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_decode_attention(q[:, :3], k, k, table, 8, ranges, ranges)
    with pytest.raises(ValueError, match="must be q.s dtype or float8_e4m3fn"):
        paged_decode_attention(q.half(), k, k, table, 8, ranges, ranges)
    with pytest.raises(ValueError, match="page_table"):
        paged_decode_attention(q, k, k, table[:1], 8, ranges, ranges)
    with pytest.raises(ValueError, match="kv_end must have 2"):
        paged_decode_attention(q, k, k, table, 8, ranges, int32([0]))


@pytest.mark.gpu
@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_dim", [(32, 8, 128), (16, 16, 64)])
def test_decode_real_size_gpu(num_q_heads, num_kv_heads, head_dim):
    gen = torch.Generator("cpu").manual_seed(3)
    ends = torch.randint(1, 5000, (64,), generator=gen).tolist()
    starts = [0 if i % 3 else min(e, 700) for i, e in enumerate(ends)]
    ends[5] = starts[5]                                  # one empty range
    run_case(starts, ends, num_q_heads, num_kv_heads, head_dim, 16, torch.bfloat16, seed=4)
