"""merge_attention_states against the float64 reference and against unsplit attention."""

import pytest
import torch

from radixrelay.kernels import merge_attention_states, merge_attention_states_reference
from radixrelay.kernels._common import attend_reference
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
