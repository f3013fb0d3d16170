"""The peer all-reduce kernels' arithmetic and indexing (one-shot and two-shot) under the Triton
interpreter, one rank at a time (``sync=False``: the interpreter runs one launch at a time and is not
thread-safe, so ranks cannot wait for each other here). The other ranks' staging buffers are filled
with what they hold when this rank reads them: their own part (one-shot; two-shot's reduce-scatter),
and, in their own segment, the sum they computed (two-shot's all-gather). The cross-GPU signalling is
checked on CUDA: tests/engine/test_tensor_parallel_gpu.py and benchmarks/kernels/bench_all_reduce.py."""

from __future__ import annotations

import pytest
import torch

from radixrelay.kernels.all_reduce import (BLOCK, VEC, all_reduce_reference, flag_count, peer_all_reduce,
                                           peer_all_reduce_add, programs_for)
from radixrelay.kernels.rms_norm import rms_norm_reference

PAD = 8          # elements past the message in every buffer: never written


def _ptrs(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)


def _segment(numel: int, world: int) -> int:
    return -(-numel // VEC // world) * VEC         # whole vectors


def _as_seen_by_others(parts: list[torch.Tensor], total: torch.Tensor, two_shot: bool) -> list[torch.Tensor]:
    world, numel = len(parts), parts[0].numel()
    seg = _segment(numel, world)
    buffers = []
    for p, part in enumerate(parts):
        buf = torch.cat([part, torch.full((PAD,), 7.0, dtype=part.dtype)])
        if two_shot:
            buf[p * seg:min(numel, (p + 1) * seg)] = total[p * seg:(p + 1) * seg]
        buffers.append(buf)
    return buffers


@pytest.mark.parametrize("two_shot", [False, True], ids=["one-shot", "two-shot"])
@pytest.mark.parametrize("world,dtype,numel,max_programs", [
    (2, torch.float32, 5 * VEC, 4),             # the last segment short
    (4, torch.bfloat16, 4 * BLOCK + 5 * VEC, 3),  # several iterations per program, ragged segments
])
def test_each_rank_gets_the_rank_order_sum(world: int, dtype: torch.dtype, numel: int, max_programs: int,
                                           two_shot: bool) -> None:
    gen = torch.Generator().manual_seed(numel)
    parts = [torch.randn(numel, generator=gen).to(dtype) for _ in range(world)]
    want = all_reduce_reference(parts)
    tol = 1e-6 if dtype == torch.float32 else 2e-2        # (the interpreter rounds fp32 -> bf16 its own way)
    seg = _segment(numel, world)
    # two-shot: a first round gives each rank's own segment of the sum; the second reads them as peers would
    total = want
    for _ in range(2 if two_shot else 1):
        outs, sums = [], torch.empty_like(want)
        for rank in range(world):
            buffers = _as_seen_by_others(parts, total, two_shot)
            buffers[rank].fill_(-3.0)                                      # this rank's: garbage until it copies
            flags = torch.zeros(flag_count(world, max_programs), dtype=torch.int32)
            epochs = torch.zeros(max_programs, dtype=torch.int32)
            x = parts[rank].clone()
            assert peer_all_reduce(x, _ptrs(buffers), _ptrs([flags] * world), epochs, rank, world, max_programs,
                                   two_shot=two_shot, sync=False) is x
            staged = buffers[rank][:numel].clone()
            if two_shot:                # its own segment now holds the sum, the rest its part
                mine = slice(rank * seg, (rank + 1) * seg)
                sums[mine] = staged[mine]
                staged[mine] = parts[rank][mine]
            assert torch.equal(staged, parts[rank])
            assert buffers[rank][numel:].eq(-3.0).all()                   # nothing written past the message
            grid = programs_for(seg if two_shot else numel, max_programs)
            assert epochs[:grid].eq(1).all() and epochs[grid:].eq(0).all()   # one call of each launched program
            outs.append(x)
        torch.testing.assert_close(outs[0], want, atol=tol, rtol=tol)
        total = sums
    assert all(torch.equal(o, outs[0]) for o in outs[1:])                 # bitwise the same on every rank
    if two_shot:
        assert torch.equal(outs[0], sums)


@pytest.mark.parametrize("with_norm", [True, False], ids=["add+norm", "add"])
@pytest.mark.parametrize("world,dtype,rows,hidden,max_programs", [
    (2, torch.float32, 5, 24, 3),               # hidden not a power of two; programs with two rows
    (4, torch.bfloat16, 3, 64, 4),              # more programs than rows
])
def test_fused_add_and_norm_equal_the_unfused_ops(world: int, dtype: torch.dtype, rows: int, hidden: int,
                                                  max_programs: int, with_norm: bool) -> None:
    """The all-reduce joined to the residual add and the RMSNorm after it: the sum in rank order, then
    the unfused ops' roundings, on every rank alike; x and the other ranks' buffers untouched."""
    gen = torch.Generator().manual_seed(rows * hidden)
    parts = [torch.randn(rows, hidden, generator=gen).to(dtype) for _ in range(world)]
    residual = torch.randn(rows, hidden, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    total = all_reduce_reference(parts)
    want_y, want_s = rms_norm_reference(total, weight, 1e-5, residual)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    outs = []
    for rank in range(world):
        buffers = [torch.cat([p.flatten(), torch.full((PAD,), 7.0, dtype=dtype)]) for p in parts]
        buffers[rank].fill_(-3.0)
        flags = torch.zeros(flag_count(world, max_programs), dtype=torch.int32)
        epochs = torch.zeros(max_programs, dtype=torch.int32)
        x = parts[rank].clone()
        out = peer_all_reduce_add(x, residual, _ptrs(buffers), _ptrs([flags] * world), epochs, rank, world,
                                  max_programs, norm=(weight, 1e-5) if with_norm else None, sync=False)
        y, s = out if with_norm else (None, out)
        assert torch.equal(x, parts[rank])                                   # x left as it was
        assert torch.equal(buffers[rank][:rows * hidden], parts[rank].flatten())
        assert buffers[rank][rows * hidden:].eq(-3.0).all()
        assert epochs[:min(rows, max_programs)].eq(1).all() and epochs[rows:].eq(0).all()
        torch.testing.assert_close(s, want_s, atol=tol, rtol=tol)
        if with_norm:
            torch.testing.assert_close(y, want_y, atol=tol, rtol=tol)
        outs.append((y, s))
    assert all(torch.equal(s, outs[0][1]) for _, s in outs)
    if with_norm:
        assert all(torch.equal(y, outs[0][0]) for y, _ in outs)


def test_fused_add_refuses_bad_shapes() -> None:
    ptrs, epochs = torch.zeros(2, dtype=torch.int64), torch.zeros(4, dtype=torch.int32)
    x = torch.zeros(2, 16)
    with pytest.raises(ValueError, match="residual must be"):
        peer_all_reduce_add(x, torch.zeros(2, 8), ptrs, ptrs, epochs, 0, 2, 4)
    with pytest.raises(ValueError, match="multiple of 8"):
        peer_all_reduce_add(torch.zeros(2, 12), torch.zeros(2, 12), ptrs, ptrs, epochs, 0, 2, 4)
    with pytest.raises(ValueError, match="norm weight"):
        peer_all_reduce_add(x, x, ptrs, ptrs, epochs, 0, 2, 4, norm=(torch.ones(8), 1e-5))


@pytest.mark.parametrize("fused", [False, True], ids=["all-reduce", "add+norm"])
def test_push_layout_writes_every_buffer_and_sums_its_own(fused: bool) -> None:
    """One-shot, push: rank r stores its message into slot r of every rank's buffer (slots of the message's
    size), then sums its own buffer's slots in rank order: the pull kernel's result, bit for bit."""
    world, rows, hidden, max_programs = 4, 3, 16, 2
    numel = rows * hidden
    gen = torch.Generator().manual_seed(5)
    parts = [torch.randn(rows, hidden, generator=gen) for _ in range(world)]
    residual, weight = torch.randn(rows, hidden, generator=gen), torch.rand(hidden, generator=gen) + 0.5
    want = all_reduce_reference(parts)
    for rank in range(world):
        # what the others pushed: every slot but this rank's own holds its owner's part; the rest is garbage
        buffers = [torch.full((world * numel + PAD,), 9.0) for _ in range(world)]
        for p in range(world):
            if p != rank:
                buffers[rank][p * numel:(p + 1) * numel] = parts[p].flatten()
        flags = torch.zeros(flag_count(world, max_programs), dtype=torch.int32)
        epochs = torch.zeros(max_programs, dtype=torch.int32)
        x = parts[rank].clone()
        args = (_ptrs(buffers), _ptrs([flags] * world), epochs, rank, world, max_programs)
        if fused:
            y, s = peer_all_reduce_add(x, residual, *args, norm=(weight, 1e-6), sync=False, push=True)
            want_y, want_s = rms_norm_reference(want, weight, 1e-6, residual)
            torch.testing.assert_close(s, want_s, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(y, want_y, atol=1e-5, rtol=1e-5)
        else:
            peer_all_reduce(x.view(-1), *args, sync=False, push=True)
            torch.testing.assert_close(x, want, atol=1e-6, rtol=1e-6)
        for q in range(world):                    # pushed into slot ``rank`` of every buffer, nothing else written
            assert torch.equal(buffers[q][rank * numel:(rank + 1) * numel], parts[rank].flatten())
            assert buffers[q][world * numel:].eq(9.0).all()
            if q != rank:
                others = [buffers[q][p * numel:(p + 1) * numel] for p in range(world) if p not in (rank, q)]
                assert all(o.eq(9.0).all() for o in others)


def test_grid_is_capped_and_covers_small_messages() -> None:
    assert programs_for(1, 132) == 1
    assert programs_for(BLOCK * 1000, 132) == 132
    assert programs_for(BLOCK + 1, 132) == 2


def test_bad_arguments_are_refused() -> None:
    ptrs, epochs = torch.zeros(2, dtype=torch.int64), torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="rank 2 outside"):
        peer_all_reduce(torch.zeros(8), ptrs, ptrs, epochs, 2, 2, 4)
    with pytest.raises(ValueError, match="int64"):
        peer_all_reduce(torch.zeros(8), ptrs.int(), ptrs, epochs, 0, 2, 4)
    with pytest.raises(ValueError, match="contiguous"):
        peer_all_reduce(torch.zeros(8, 2).t(), ptrs, ptrs, epochs, 0, 2, 4)
    with pytest.raises(ValueError, match="multiple of 8"):
        peer_all_reduce(torch.zeros(12), ptrs, ptrs, epochs, 0, 2, 4)
    with pytest.raises(ValueError, match="power of two"):
        three = torch.zeros(3, dtype=torch.int64)
        peer_all_reduce(torch.zeros(8), three, three, epochs, 0, 3, 4)
