"""shared_node_attention against the float64 reference, and a full cascade (shared nodes + paged
suffix + merge) against flat paged decode."""

import pytest
import torch

from radixrelay.kernels import (merge_attention_states, paged_decode_attention, paged_decode_attention_reference,
                                shared_node_attention, shared_node_attention_reference)
from radixrelay.kernels import shared_node as shared_mod
from tests.kernels.helpers import (DEVICE, assert_close_attention, int32, make_cache, page_lists, page_table,
                                   poisoned)


def build_groups(group_rows: list[list[int]], kv_lens: list[int], page_size: int, num_pages: int, gen,
                 contiguous: bool = False):
    """Index tensors of shared_node_attention for groups of request indices over random page runs (with
    ``contiguous``: each run is consecutive page ids, runs in random order with a gap page between)."""
    runs = page_lists(kv_lens, page_size, num_pages, gen)
    if contiguous:
        at = 1
        for i in torch.randperm(len(runs), generator=torch.Generator().manual_seed(len(runs))).tolist():
            runs[i] = torch.arange(at, at + len(runs[i]), dtype=torch.int32, device=DEVICE)
            at += len(runs[i]) + 1
    q_indptr = int32([0] + torch.tensor([len(r) for r in group_rows]).cumsum(0).tolist())
    kv_indptr = int32([0] + torch.tensor([len(r) for r in runs]).cumsum(0).tolist())
    q_rows = int32([i for rows in group_rows for i in rows])
    kv_pages = torch.cat(runs) if runs else int32([])
    return q_indptr, q_rows, kv_indptr, kv_pages, int32(kv_lens)


def run_case(batch, group_rows, kv_lens, num_q_heads, num_kv_heads, head_dim, page_size, dtype, seed,
             contiguous=False, **launch):
    gen = torch.Generator(DEVICE).manual_seed(seed)
    num_pages = sum(-(-n // page_size) for n in kv_lens) + len(kv_lens) + 2
    k_cache, v_cache = make_cache(num_pages, page_size, num_kv_heads, head_dim, dtype, gen)
    index = build_groups(group_rows, kv_lens, page_size, num_pages, gen, contiguous)
    if contiguous:
        assert shared_mod.pages_contiguous(index[2], index[3])
        launch["kv_contiguous"] = True
    q = torch.randn((batch, num_q_heads, head_dim), generator=gen, device=DEVICE).to(dtype)
    out = poisoned((index[1].numel(), num_q_heads, head_dim), dtype)
    if launch.get("config"):   # drive the launcher directly to pin tiles and split count
        shared_mod._launch(q, k_cache, v_cache, page_size, *index, head_dim**-0.5, *out,
                           num_q_heads // num_kv_heads, max(map(len, group_rows)), max(kv_lens), **launch)
        o, lse = out
    else:
        o, lse = shared_node_attention(q, k_cache, v_cache, page_size, *index, out=out,
                                       kv_contiguous=launch.get("kv_contiguous", False))
    o_ref, lse_ref = shared_node_attention_reference(q, k_cache, v_cache, page_size, *index)
    assert_close_attention(o, lse, o_ref, lse_ref, dtype)


@pytest.mark.parametrize(
    "num_q_heads, num_kv_heads, head_dim, page_size",
    [(8, 2, 64, 16), (4, 4, 32, 4), (6, 2, 128, 8)],    # GQA 4, MHA, GQA 3
)
def test_shared_node_groups(num_q_heads, num_kv_heads, head_dim, page_size):
    # a root shared by all, two children (overlapping requests), an empty node, a one-request node
    group_rows = [[0, 1, 2, 3, 4, 5, 6], [1, 3, 5], [0, 2], [4], [6]]
    kv_lens = [70, 2 * page_size, 13, 0, 1]
    run_case(7, group_rows, kv_lens, num_q_heads, num_kv_heads, head_dim, page_size, torch.float32, seed=head_dim)


@pytest.mark.parametrize("config, slots_per_sm", [((16, 16, 4, 1), 1), ((32, 32, 4, 1), 64)])
def test_shared_node_tiles_and_splits(config, slots_per_sm):
    """Several query tiles per group (16 rows < 9 requests x 4 heads), with many splits and with one."""
    group_rows = [list(range(9)), [8, 2]]
    run_case(9, group_rows, [200, 45], 8, 2, 32, 4, torch.float32, seed=5, config=config,
             slots_per_sm=slots_per_sm, overhead=0)


def test_shared_node_rejects_bad_arguments():
    q = torch.zeros((2, 4, 32), device=DEVICE)
    k = torch.zeros((16, 2, 32), device=DEVICE)
    idx = int32([0, 2])
    with pytest.raises(ValueError, match="kv_lens must have 1"):
        shared_node_attention(q, k, k, 8, idx, int32([0, 1]), int32([0, 1]), int32([0]), int32([8, 8]))
    with pytest.raises(ValueError, match="head_dim must be a power of two"):
        shared_node_attention(q[..., :24], k[..., :24], k[..., :24], 8, idx, int32([0, 1]), int32([0, 1]),
                              int32([0]), int32([8]))


def run_cascade(batch, prefix_len, suffix_lens, num_q_heads, num_kv_heads, head_dim, page_size, dtype, seed):
    """Requests share a prefix (one page run) and own their suffix; cascade == flat decode."""
    gen = torch.Generator(DEVICE).manual_seed(seed)
    prefix_pages = -(-prefix_len // page_size)
    num_pages = prefix_pages + sum(-(-s // page_size) for s in suffix_lens) + 1
    k_cache, v_cache = make_cache(num_pages, page_size, num_kv_heads, head_dim, dtype, gen)
    perm = torch.randperm(num_pages, generator=gen, device=DEVICE).to(torch.int32)
    shared, own = perm[:prefix_pages], page_lists(suffix_lens, page_size, num_pages - prefix_pages, gen)
    table = page_table([torch.cat([shared, perm[prefix_pages:][p.long()]]) for p in own])
    q = torch.randn((batch, num_q_heads, head_dim), generator=gen, device=DEVICE).to(dtype)
    ends = int32([prefix_len + s for s in suffix_lens])
    # parts buffer [B, 2, Hq, D]: level 0 = shared prefix, level 1 = own suffix
    o_parts, lse_parts = poisoned((batch, 2, num_q_heads, head_dim), dtype)
    shared_node_attention(q, k_cache, v_cache, page_size, int32([0, batch]), int32(list(range(batch))),
                          int32([0, prefix_pages]), shared, int32([prefix_len]), out=(o_parts[:, 0], lse_parts[:, 0]))
    paged_decode_attention(q, k_cache, v_cache, table, page_size, int32([prefix_len] * batch), ends,
                           out=(o_parts[:, 1], lse_parts[:, 1]))
    indptr, part_ids = int32(list(range(0, 2 * batch + 1, 2))), int32(list(range(2 * batch)))
    o, lse = merge_attention_states(o_parts.view(2 * batch, num_q_heads, head_dim), lse_parts.view(2 * batch, -1),
                                    indptr, part_ids)
    o_ref, lse_ref = paged_decode_attention_reference(q, k_cache, v_cache, table, page_size,
                                                      int32([0] * batch), ends)
    assert_close_attention(o, lse, o_ref, lse_ref, dtype)


def test_cascade_equals_flat_decode():
    run_cascade(5, 48, [0, 1, 17, 33, 8], 8, 2, 64, 16, torch.float32, seed=6)


@pytest.mark.gpu
@pytest.mark.parametrize("batch, prefix_len", [(256, 4096), (8, 16384)])
def test_shared_node_real_size_gpu(batch, prefix_len):
    group_rows = [list(range(batch)), list(range(0, batch, 2)), [batch - 1]]
    run_case(batch, group_rows, [prefix_len, 1000, 0], 32, 8, 128, 16, torch.bfloat16, seed=7)


@pytest.mark.gpu
def test_cascade_real_size_gpu():
    suffixes = torch.randint(0, 600, (128,), generator=torch.Generator().manual_seed(8)).tolist()
    run_cascade(128, 8192, suffixes, 32, 8, 128, 16, torch.bfloat16, seed=9)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [(64, 128, 4, 2), (64, 64, 4, 4), (128, 64, 8, 3), (128, 128, 8, 2),
                                    (128, 128, 8, 3)])
def test_shared_node_tile_configs_gpu(config):
    """The tile configs the H100 sweep tried (benchmarks/results/HISTORY.md, v6), bf16 at real sizes, with a
    partial last tile and a second group."""
    group_rows = [list(range(256)), list(range(0, 256, 3))]
    run_case(256, group_rows, [4096 + 24, 1000], 32, 8, 128, 16, torch.bfloat16, seed=11, config=config)


def test_pages_contiguous():
    ok = shared_mod.pages_contiguous
    assert ok(int32([0, 3, 3, 5]), int32([7, 8, 9, 2, 3]))           # runs 7-9 and 2-3, an empty group
    assert not ok(int32([0, 3, 5]), int32([7, 8, 10, 2, 3]))
    assert not ok(int32([0, 2]), int32([4, 3]))
    assert ok(int32([0, 0]), int32([])) and ok(int32([0, 1]), int32([5]))


def test_shared_node_contiguous_falls_back():
    """kv_contiguous on a machine without TMA (CPU interpreter here) runs the gather path, same results."""
    group_rows = [[0, 1, 2, 3, 4], [1, 3], [2]]
    run_case(5, group_rows, [70, 13, 0], 8, 2, 32, 16, torch.float32, seed=12, contiguous=True)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, (64, 64, 4, 3), (64, 64, 4, 4), (128, 128, 8, 3), (128, 64, 8, 3),
                                    (64, 128, 4, 2)])
def test_shared_node_tma_gpu(config):
    """Consecutive page runs: full K/V tiles by TMA on Hopper (the gather elsewhere), bf16 at real sizes;
    partial last tiles, an empty node, a one-token node, runs not starting at page 0."""
    assert shared_mod.tma_capable(torch.device("cuda")) == (torch.cuda.get_device_capability()[0] >= 9)
    group_rows = [list(range(256)), list(range(0, 256, 3)), [7], [3, 9]]
    launch = {"config": config} if config else {}
    run_case(256, group_rows, [8192 + 40, 1000, 0, 1], 32, 8, 128, 16, torch.bfloat16, seed=13, contiguous=True,
             **launch)
