"""merge_attention_states and merge_into_rows against the float64 reference and against unsplit attention;
the Triton backend's prefill cascade (shared runs merged into the extend rows) against the flat reference."""

import pytest
import torch

from radixrelay.attention import BatchRequest, KVCache, build_forward_batch
from radixrelay.attention.backend import TorchBackend
from radixrelay.attention.metadata import SharedRun, build_shared_runs
from radixrelay.attention.triton_backend import TritonBackend
from radixrelay.kernels import merge_attention_states, merge_attention_states_reference
from radixrelay.kernels._common import attend_reference
from radixrelay.kernels.merge import merge_into_rows, merge_into_rows_reference
from tests.kernels.helpers import DEVICE, assert_close_attention, int32, poisoned


def test_merge_rows_with_empty_parts_never_nan():
    gen = torch.Generator(DEVICE).manual_seed(0)
    num_parts, heads, head_dim = 9, 3, 32
    o_parts = torch.randn((num_parts, heads, head_dim), generator=gen, device=DEVICE)
    lse_parts = torch.randn((num_parts, heads), generator=gen, device=DEVICE) * 4
    lse_parts[2] = float("-inf")                      # an empty part whose o holds garbage
    o_parts[2] = float("nan")
    lse_parts[5, 1] = float("-inf")                   # empty for one head only
    o_parts[5, 1] = float("nan")
    # rows: 3 parts, none, only the empty part, one part reused, 4 parts incl. the empty one
    indptr = int32([0, 3, 3, 4, 5, 9])
    part_ids = int32([0, 1, 5, 2, 1, 3, 2, 4, 8])
    o, lse = merge_attention_states(o_parts, lse_parts, indptr, part_ids, out=poisoned((5, heads, head_dim),
                                                                                        torch.float32))
    o_ref, lse_ref = merge_attention_states_reference(o_parts, lse_parts, indptr, part_ids)
    assert_close_attention(o, lse, o_ref, lse_ref, torch.float32)
    assert torch.isneginf(lse[1]).all() and torch.isneginf(lse[2]).all()
    torch.testing.assert_close(o[3], o_parts[1])      # a single part passes through unchanged


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_of_segments_equals_whole(dtype):
    """Attention over KV split into segments (some empty), merged, equals attention over the whole."""
    gen = torch.Generator(DEVICE).manual_seed(1)
    rows, hq, hkv, d = 5, 4, 2, 64
    q = torch.randn((rows, hq, d), generator=gen, device=DEVICE)
    k = torch.randn((40, hkv, d), generator=gen, device=DEVICE)
    v = torch.randn((40, hkv, d), generator=gen, device=DEVICE)
    bounds = [0, 7, 7, 30, 40]                        # segment 1 is empty
    parts = [attend_reference(q, k[a:b], v[a:b], d**-0.5) for a, b in zip(bounds[:-1], bounds[1:])]
    o_parts = torch.cat([p[0] for p in parts]).to(dtype)          # [4 * rows, hq, d], segment-major
    lse_parts = torch.cat([p[1] for p in parts]).float()
    indptr = int32(list(range(0, 4 * rows + 1, 4)))
    part_ids = int32([s * rows + r for r in range(rows) for s in range(4)])
    o, lse = merge_attention_states(o_parts, lse_parts, indptr, part_ids)
    o_ref, lse_ref = attend_reference(q, k, v, d**-0.5)
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert_close_attention(o, lse, o_ref, lse_ref, dtype)


def test_merge_rejects_bad_arguments():
    o_parts = torch.zeros((2, 3, 32), device=DEVICE)
    lse = torch.zeros((2, 3), device=DEVICE)
    with pytest.raises(ValueError, match="int32"):
        merge_attention_states(o_parts, lse, torch.tensor([0, 2], device=DEVICE), int32([0, 1]))
    with pytest.raises(ValueError, match="lse_parts"):
        merge_attention_states(o_parts, lse[:1], int32([0, 2]), int32([0, 1]))


@pytest.mark.gpu
def test_merge_three_levels_real_size_gpu():
    gen = torch.Generator(DEVICE).manual_seed(2)
    rows, heads, d, levels = 256, 32, 128, 3
    o_parts = torch.randn((levels * rows, heads, d), generator=gen, device=DEVICE).bfloat16()
    lse_parts = torch.randn((levels * rows, heads), generator=gen, device=DEVICE) * 3
    lse_parts[:rows:7] = float("-inf")
    indptr = torch.arange(0, levels * rows + 1, levels, dtype=torch.int32, device=DEVICE)
    part_ids = torch.arange(levels * rows, dtype=torch.int32, device=DEVICE).view(levels, rows).t().flatten()
    o, lse = merge_attention_states(o_parts, lse_parts, indptr, part_ids.contiguous(),
                                    out=poisoned((rows, heads, d), torch.bfloat16))
    o_ref, lse_ref = merge_attention_states_reference(o_parts, lse_parts, indptr, part_ids)
    assert_close_attention(o, lse, o_ref, lse_ref, torch.bfloat16)


def _states(gen, num_rows: int, heads: int, head_dim: int, dtype):
    """Random (o [N, H, D] dtype, lse [N, H] float32)."""
    o = torch.randn((num_rows, heads, head_dim), generator=gen, device=DEVICE).to(dtype)
    return o, torch.randn((num_rows, heads), generator=gen, device=DEVICE) * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_h", [None, 1, 2])
def test_merge_into_rows_matches_reference(dtype, block_h):
    gen = torch.Generator(DEVICE).manual_seed(3)
    num_rows, heads, head_dim = 9, 3, 24                 # heads and head_dim not powers of two: masked tiles
    o, lse = _states(gen, num_rows, heads, head_dim, dtype)
    rows = int32([7, 0, 3, 5, 8, 1])                     # distinct, unordered; rows 2, 4, 6 untouched
    o_part, lse_part = _states(gen, rows.numel(), heads, head_dim, dtype)
    lse[0] = float("-inf")                               # row 0: its own side empty (o holds garbage)
    o[0] = float("nan")
    lse_part[1] = float("-inf")                          # entry 1 (row 0): both sides empty
    o_part[1] = float("nan")
    lse_part[2] = float("-inf")                          # entry 2 (row 3): the part empty
    o_part[2] = float("nan")
    lse[5, 1] = float("-inf")                            # one head of row 5 empty on its own side
    lse_part[4, 2] = float("-inf")                       # one head of entry 4 (row 8) empty
    lse[1], lse_part[5] = float("-inf"), 2.0             # row 1: only the part
    o_ref, lse_ref = merge_into_rows_reference(o, lse, rows, o_part, lse_part)
    o_before, lse_before = o.clone(), lse.clone()
    merge_into_rows(o, lse, rows, o_part, lse_part, block_h=block_h)
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert torch.isneginf(lse[0]).all() and (o[0] == 0).all()
    assert_close_attention(o, lse, o_ref, lse_ref, dtype)
    untouched = [2, 4, 6]
    assert torch.equal(o[untouched], o_before[untouched]) and torch.equal(lse[untouched], lse_before[untouched])
    assert torch.equal(o[3], o_before[3]) and torch.equal(lse[3], lse_before[3])       # empty part: unchanged
    assert torch.equal(o[1], o_part[5]) and torch.equal(lse[1], lse_part[5])            # empty row: the part
    assert torch.equal(o[5, 1], o_part[3, 1]) and torch.equal(lse[5, 1], lse_part[3, 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_into_rows_of_segments_equals_whole(dtype):
    """Attention over KV[a:] merged in place with attention over KV[:a] equals attention over the whole."""
    gen = torch.Generator(DEVICE).manual_seed(4)
    tokens, hq, hkv, d, split = 6, 4, 2, 32, 13
    q = torch.randn((tokens, hq, d), generator=gen, device=DEVICE)
    k = torch.randn((30, hkv, d), generator=gen, device=DEVICE)
    v = torch.randn((30, hkv, d), generator=gen, device=DEVICE)
    rows = int32([4, 1, 2])
    o, lse = (t.to(dt) for t, dt in zip(attend_reference(q, k[split:], v[split:], d**-0.5), (dtype, torch.float32)))
    o_part, lse_part = attend_reference(q[rows.long()], k[:split], v[:split], d**-0.5)
    merge_into_rows(o, lse, rows, o_part.to(dtype), lse_part.float())
    o_ref, lse_ref = attend_reference(q, k, v, d**-0.5)
    assert_close_attention(o[rows.long()], lse[rows.long()], o_ref[rows.long()], lse_ref[rows.long()], dtype)


def test_merge_into_rows_rejects_bad_arguments():
    o, lse = torch.zeros((4, 2, 16), device=DEVICE), torch.zeros((4, 2), device=DEVICE)
    o_part, lse_part = torch.zeros((2, 2, 16), device=DEVICE), torch.zeros((2, 2), device=DEVICE)
    with pytest.raises(ValueError, match="int32"):
        merge_into_rows(o, lse, torch.tensor([0, 1], device=DEVICE), o_part, lse_part)
    with pytest.raises(ValueError, match="o_part"):
        merge_into_rows(o, lse, int32([0, 1, 2]), o_part, lse_part)
    with pytest.raises(ValueError, match="lse_part"):
        merge_into_rows(o, lse, int32([0, 1]), o_part, lse_part.double())
    with pytest.raises(ValueError, match="lse must be"):
        merge_into_rows(o, lse[:, :1], int32([0, 1]), o_part, lse_part)
    merge_into_rows(o, lse, int32([]), o_part[:0], lse_part[:0])       # no rows: nothing to launch


PAGE = 2


def _prefill_batches(two_levels: bool):
    """A mixed step (3 extends, 1 decode) flat and with prefill cascade: run A (pages 10, 11) is read by every
    extend; with ``two_levels`` run B (pages 12, 13) by the first two as well, so that their rows sit in two
    runs and get both parts."""
    extends = [BatchRequest([10, 11, 12, 13, 20], 8, 2), BatchRequest([10, 11, 12, 13, 21, 22], 8, 3),
               BatchRequest([10, 11, 30, 31], 5, 2)]
    work = extends + [BatchRequest([40, 41], 3, 1)]
    runs = [SharedRun(list(range(7)), [10, 11], 4)]                   # flat rows: 0-1, 2-4, 5-6
    kv_start = [4, 4, 4, 0]
    if two_levels:
        runs.append(SharedRun(list(range(5)), [12, 13], 4))
        kv_start = [8, 8, 4, 0]
    flat = build_forward_batch(work, PAGE, DEVICE, num_decodes=1)
    cascaded = build_forward_batch(work, PAGE, DEVICE, num_decodes=1, kv_start=kv_start,
                                   prefill_runs=build_shared_runs(runs, DEVICE))
    return flat, cascaded


@pytest.mark.parametrize("two_levels", [False, True])
def test_triton_backend_prefill_runs_match_reference(two_levels):
    """The Triton backend's prefill cascade (shared node, extend, merge into the extend rows) over two layers
    against the float64 torch reference of the flat batch."""
    flat, cascaded = _prefill_batches(two_levels)
    gen = torch.Generator().manual_seed(5)
    cache = KVCache(num_layers=2, num_pages=48, page_size=PAGE, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                    device=DEVICE)
    for t in cache.k + cache.v:
        t.copy_(torch.randn(t.shape, generator=gen))
    ref_cache = KVCache(num_layers=2, num_pages=48, page_size=PAGE, num_kv_heads=2, head_dim=16,
                        dtype=torch.float64, device=DEVICE)
    for t, src in zip(ref_cache.k + ref_cache.v, cache.k + cache.v):
        t.copy_(src)
    backend = TritonBackend()
    for layer in range(2):
        q = torch.randn((flat.num_tokens, 4, 16), generator=gen).to(DEVICE)
        o, lse = backend.forward_with_lse(q, layer, cache, cascaded)
        want_o, want_lse = TorchBackend().forward_with_lse(q.double(), layer, ref_cache, flat)
        torch.testing.assert_close(o.double(), want_o, rtol=0, atol=2e-5)
        torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=2e-5)
    assert len(backend._step.layers.merges) == (2 if two_levels else 1)   # run by run where rows repeat


def test_triton_backend_rejects_a_row_twice_in_one_run():
    runs = build_shared_runs([SharedRun([0, 1, 1], [10, 11], 4)], DEVICE)
    batch = build_forward_batch([BatchRequest([10, 11, 12, 13, 20], 8, 2)], PAGE, DEVICE, kv_start=[4],
                                prefill_runs=runs)
    cache = KVCache(num_layers=1, num_pages=48, page_size=PAGE, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                    device=DEVICE)
    with pytest.raises(ValueError, match="appears twice in one run"):
        TritonBackend().forward_with_lse(torch.zeros((2, 4, 16), device=DEVICE), 0, cache, batch)
