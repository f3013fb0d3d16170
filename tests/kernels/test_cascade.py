"""cascade_decode_attention (shared nodes + own KV + one merge) against the float64 reference."""

import pytest
import torch

from radixrelay.kernels import cascade_decode_attention, cascade_decode_attention_reference, plan_cascade
from radixrelay.kernels.cascade_decode import LIGHT_NODE_TOKENS, OWN_BESIDE, OWN_BESIDE_LIGHT
from tests.kernels.helpers import DEVICE, assert_close_attention, int32, make_cache, page_lists, page_table


def run_case(group_rows, node_lens, own_ranges, num_q_heads, num_kv_heads, head_dim, page_size, dtype, seed,
             side_stream=None, contiguous=False, adjust=None, **splits):
    """Requests own disjoint pages for their own ranges; nodes are separate page runs (with ``contiguous``
    each node's run is consecutive page ids); ``adjust``: plan -> the plan to run. Returns the plan."""
    gen = torch.Generator(DEVICE).manual_seed(seed)
    ends = [e for _, e in own_ranges]
    lists = page_lists(node_lens + ends, page_size, sum(-(-n // page_size) for n in node_lens + ends) + 2, gen)
    num_pages = sum(len(p) for p in lists) + 2
    k_cache, v_cache = make_cache(num_pages, page_size, num_kv_heads, head_dim, dtype, gen)
    runs, own = lists[: len(node_lens)], lists[len(node_lens):]
    if contiguous:   # node runs become consecutive ids 0.., the own lists a permutation of the rest
        n_node = sum(len(r) for r in runs)
        rest = n_node + torch.randperm(num_pages - n_node, generator=gen, device=DEVICE).to(torch.int32)
        runs = list(torch.arange(n_node, dtype=torch.int32, device=DEVICE).split([len(r) for r in runs]))
        own = list(rest[: sum(len(p) for p in own)].split([len(p) for p in own]))
    index = (
        int32([0] + torch.tensor([len(r) for r in group_rows], dtype=torch.long).cumsum(0).tolist()),
        int32([b for rows in group_rows for b in rows]),
        int32([0] + torch.tensor([len(r) for r in runs], dtype=torch.long).cumsum(0).tolist()),
        torch.cat(runs) if runs else int32([]),
        int32(node_lens),
        page_table(own),
        int32([s for s, _ in own_ranges]),
        int32(ends),
    )
    q = torch.randn((len(own_ranges), num_q_heads, head_dim), generator=gen, device=DEVICE).to(dtype)
    plan = plan_cascade(*index, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                        page_size=page_size, **splits)
    if adjust is not None:
        plan = adjust(plan)
    o, lse = cascade_decode_attention(q, k_cache, v_cache, plan, side_stream=side_stream)
    o_ref, lse_ref = cascade_decode_attention_reference(q, k_cache, v_cache, page_size, *index)
    assert_close_attention(o, lse, o_ref, lse_ref, dtype)
    return plan


@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_dim, page_size", [(8, 2, 64, 16), (4, 4, 32, 4)])
@pytest.mark.parametrize("splits", [{}, {"shared_splits": 3, "own_splits": 2}])
def test_cascade_two_levels(num_q_heads, num_kv_heads, head_dim, page_size, splits):
    # root node shared by all 6, a child node shared by 3, an empty node; request 5 has no own tokens
    # and request 4 is in no group but the root; request 2 attends nothing beyond the root
    group_rows = [[0, 1, 2, 3, 4, 5], [0, 1, 3], [5]]
    node_lens = [40, 2 * page_size, 0]
    own_ranges = [(0, 9), (0, 1), (0, 0), (3, 50), (0, 17), (0, 0)]
    run_case(group_rows, node_lens, own_ranges, num_q_heads, num_kv_heads, head_dim, page_size, torch.float32,
             seed=head_dim, **splits)


def test_split_count_fixed_for_nodes_of_any_length():
    """A split count fixed beforehand (a captured graph's) over nodes of very different lengths: each node
    cuts its own chunks at run time, so splits past a short node's end attend nothing, and the result is
    exact for every node (the longest, one shorter than the splits' tiles, an empty one)."""
    group_rows = [[0, 1, 2, 3], [1, 2], [3], [0]]
    node_lens = [300, 70, 5, 0]
    own_ranges = [(0, 9), (0, 3), (0, 0), (2, 40)]
    plan = run_case(group_rows, node_lens, own_ranges, 8, 2, 32, 8, torch.float32, seed=11, shared_splits=7)
    assert plan.shared_splits == 7


def test_light_nodes_pick_the_short_tile_own_decode():
    """Every node <= LIGHT_NODE_TOKENS: the own KV beside them takes OWN_BESIDE_LIGHT; one longer node: OWN_BESIDE."""
    light = run_case([[0, 1, 2]], [LIGHT_NODE_TOKENS], [(0, 5), (0, 0), (2, 30)], 4, 2, 16, 64, torch.float32, seed=9)
    heavy = run_case([[0, 1, 2], [0, 1]], [LIGHT_NODE_TOKENS + 64, 16], [(0, 5), (0, 0), (2, 30)], 4, 2, 16, 64,
                     torch.float32, seed=9)
    assert light.light_nodes and light.own_options == OWN_BESIDE_LIGHT
    assert not heavy.light_nodes and heavy.own_options == OWN_BESIDE


def test_cascade_without_shared_nodes():
    run_case([], [], [(0, 30), (5, 5)], 4, 2, 32, 8, torch.float32, seed=3)


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [False, True])
def test_cascade_real_size_gpu(overlap):
    batch = 128
    group_rows = [list(range(batch)), list(range(0, batch, 2)), list(range(1, batch, 4))]
    own = [(0, int(n)) for n in torch.randint(0, 700, (batch,), generator=torch.Generator().manual_seed(5))]
    side = torch.cuda.Stream() if overlap else None
    run_case(group_rows, [8192, 1024, 4000], own, 32, 8, 128, 16, torch.bfloat16, seed=6, side_stream=side)


@pytest.mark.gpu
def test_cascade_light_nodes_real_size_gpu():
    """A 2K system prompt over 256 requests with short own ranges, the own KV beside it in 32-token tiles."""
    batch = 256
    own = [(0, int(n)) for n in torch.randint(0, 300, (batch,), generator=torch.Generator().manual_seed(11))]
    plan = run_case([list(range(batch))], [2048], own, 32, 8, 128, 16, torch.bfloat16, seed=12,
                    side_stream=torch.cuda.Stream(), contiguous=True)
    assert plan.light_nodes


def test_cascade_contiguous_nodes():
    """Nodes on consecutive pages but few rows (12 < TMA_MIN_ROWS): the gather path everywhere."""
    plan = run_case([[0, 1, 2], [1, 2]], [40, 20], [(0, 5), (0, 0), (2, 30)], 8, 2, 32, 16, torch.float32, seed=4,
                    contiguous=True)
    assert not plan.kv_tma


def contiguous_real_size(overlap: bool, **options):
    """256 requests over a 16K node and a 1K node on consecutive pages, bf16, Llama-3-8B heads; the plan."""
    batch = 256
    group_rows = [list(range(batch)), list(range(0, batch, 2))]
    own = [(0, int(n)) for n in torch.randint(0, 300, (batch,), generator=torch.Generator().manual_seed(7))]
    side = torch.cuda.Stream() if overlap else None
    return run_case(group_rows, [16384, 1000], own, 32, 8, 128, 16, torch.bfloat16, seed=8, side_stream=side,
                    contiguous=True, **options)


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [False, True])
def test_cascade_contiguous_real_size_gpu(overlap):
    plan = contiguous_real_size(overlap)
    assert plan.kv_tma == (torch.cuda.get_device_capability()[0] >= 9)
