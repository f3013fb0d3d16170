"""All-reduce over the GPUs of one host in one launch, through peer-mapped (symmetric) memory: one-shot
and two-shot.

API::

    peer_all_reduce(x, buffer_ptrs, flag_ptrs, epochs, rank, world, max_programs, two_shot=False) -> x  (in place)
    peer_all_reduce_add(x, residual, buffer_ptrs, flag_ptrs, epochs, rank, world, max_programs,
                        norm=None) -> s, or (y, s) with norm=(weight, eps)

    x:           [N] contiguous fp16 / bf16 / fp32 on this rank's GPU, N a multiple of VEC: this rank's
                 partial sums in, the sum out
    buffer_ptrs: [world] int64, the address of every rank's staging buffer (>= N elements of x's dtype,
                 16-byte aligned), readable from this GPU (``torch.distributed._symmetric_memory``)
    flag_ptrs:   [world] int64, the address of every rank's int32 flags, [SLOTS, max_programs, world]
                 each, zero before the first call
    epochs:      [max_programs] int32 of this rank only, zero before the first call: the call count of
                 each program

one-shot: each rank copies its ``x`` into its staging buffer, then sums the whole message over every
rank's buffer. two-shot: the message in ``world`` segments; rank r sums segment r over every rank's
buffer into its own buffer (reduce-scatter), then every rank copies the other segments' sums from
their owners' buffers (all-gather): (world - 1) / world of the message crosses the links twice,
instead of (world - 1) times. Either way the sums are fp32 in rank order and every rank ends with
bitwise the same result.

``peer_all_reduce_add`` is one-shot with the layer's next ops fused (the decoder's residual add, and the
RMSNorm after it): x [rows, hidden] the partial sums, residual [rows, hidden]; s = sum + residual and
y = RMSNorm(s) * weight, new tensors, with the roundings of the unfused ops (the sum rounded to the dtype,
then ``radixrelay.kernels.rms_norm`` with its residual). Program b handles whole rows b, b + programs, ...

Program ``b`` of every rank handles the same elements (``b * BLOCK`` onwards every ``programs * BLOCK``,
within the message or within each segment), so the ranks synchronise program by program, never the
whole grid: between phases, program b tells program b of every rank that it reached the phase of
call ``epoch`` (a release store of the epoch into its flag in every rank's pad: one round trip, every
rank at once) and waits until all of them told it (acquire reads of its own pad). The last phase's
signal says its reads of the others' buffers are done, so no rank's next call overwrites a buffer
another still reads. The grid must not exceed the programs the GPU keeps resident (one per SM here),
or a program could wait for a peer program that never gets an SM. ``sync=False`` skips the signals
(the CPU interpreter runs one launch at a time: only the arithmetic is testable there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixrelay.kernels._common import FLOAT_DTYPES, check

BLOCK = 2048            # elements per program per iteration (8 warps: 16-byte loads)
NUM_WARPS = 8
VEC = 8                 # a message is a multiple of VEC elements
_VEC = tl.constexpr(VEC)


@triton.jit
def _exchange(flag_ptrs, slot, pid, epoch, rank: tl.constexpr, world: tl.constexpr, max_programs):
    # Tell program ``pid`` of every rank that this one reached ``slot`` of call ``epoch`` (a release store of
    # the epoch into this rank's flag in every pad: [slot, pid, rank]), then wait until each of them told
    # this one (acquire reads of [slot, pid, peer] in this rank's pad until all hold the epoch). One
    # round trip: every peer is signalled at once, one thread each. This rank's own flag is set and read
    # too (no branch on the peer). A peer cannot be a call ahead: it would first need this rank's next
    # signal, so equality is enough and the int32 epoch may wrap.
    tl.debug_barrier()                     # every thread's writes (and reads) of this program are done
    peers = tl.arange(0, world)
    at = (slot * max_programs + pid) * world
    pads = tl.load(flag_ptrs + peers).to(tl.pointer_type(tl.int32))
    tl.atomic_xchg(pads + at + rank, tl.full([world], 0, tl.int32) + epoch, sem="release", scope="sys")
    mine = tl.load(flag_ptrs + rank).to(tl.pointer_type(tl.int32)) + at + peers
    nothing = tl.full([world], 0, tl.int32)
    arrived = 0
    while arrived == 0:                    # (the loop carries a scalar: triton 3.6 cannot carry the tensor)
        seen = tl.atomic_add(mine, nothing, sem="acquire", scope="sys")
        arrived = tl.min((seen == epoch).to(tl.int32), axis=0)
    tl.debug_barrier()


@triton.jit
def _rank_buffer(buffer_ptrs, rank, dtype):
    # rank ``rank``'s staging buffer; its address is 16-byte aligned (symmetric memory allocations are)
    return tl.multiple_of(tl.load(buffer_ptrs + rank).to(tl.pointer_type(dtype)), 16)


@triton.jit
def _sum_over_ranks(buffer_ptrs, offs, ok, dtype, world: tl.constexpr, BLOCK: tl.constexpr):
    # the ranks' values at ``offs``, added in rank order in fp32
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for peer in tl.static_range(world):
        buf = _rank_buffer(buffer_ptrs, peer, dtype)
        acc += tl.load(buf + offs, mask=ok, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _stage(x, buffer_ptrs, own, slot_stride, offs, ok, dtype, rank: tl.constexpr, world: tl.constexpr,
           PUSH: tl.constexpr):
    # one-shot's first phase: this rank's values at ``offs`` into its slot of every buffer (push), or into
    # its own buffer (pull)
    values = tl.load(x + offs, mask=ok)
    if PUSH:
        _push(buffer_ptrs, values, slot_stride, offs, ok, dtype, rank, world)
    else:
        tl.store(own + offs, values, mask=ok)


@triton.jit
def _one_shot_sum(buffer_ptrs, own, slot_stride, offs, ok, dtype, world: tl.constexpr, PUSH: tl.constexpr,
                  BLOCK: tl.constexpr):
    # one-shot's second phase: the ranks' values at ``offs`` added in rank order (fp32)
    if PUSH:
        total = _sum_slots(own, slot_stride, offs, ok, world, BLOCK)
    else:
        total = _sum_over_ranks(buffer_ptrs, offs, ok, dtype, world, BLOCK)
    return total


# The size varies per call (rows of a step): not specialised, so one variant serves every size; it is
# passed in vectors of VEC elements (every message is a multiple: rows x hidden).
@triton.jit
def _sum_slots(own, slot_stride, offs, ok, world: tl.constexpr, BLOCK: tl.constexpr):
    # push layout: the ranks' values at ``offs`` in this rank's own buffer, slot p = rank p's, in rank order (fp32)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for peer in tl.static_range(world):
        acc += tl.load(own + peer * slot_stride + offs, mask=ok, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _push(buffer_ptrs, values, slot_stride, offs, ok, dtype, rank: tl.constexpr, world: tl.constexpr):
    # push layout: ``values`` into slot ``rank`` of every rank's buffer (stores over the links; this rank's own too)
    for peer in tl.static_range(world):
        tl.store(_rank_buffer(buffer_ptrs, peer, dtype) + rank * slot_stride + offs, values, mask=ok)


# The size varies per call (rows of a step): not specialised, so one variant serves every size; it is
# passed in vectors of VEC elements (every message is a multiple: rows x hidden).
@triton.jit(do_not_specialize=["vectors"])
def _one_shot_kernel(x, buffer_ptrs, flag_ptrs, epochs, vectors, max_programs,
                     rank: tl.constexpr, world: tl.constexpr, SYNC: tl.constexpr, PUSH: tl.constexpr,
                     BLOCK: tl.constexpr):
    # grid: (programs,); program b: elements [b * BLOCK + k * programs * BLOCK, + BLOCK) for k = 0, 1, ...
    numel = vectors * _VEC                 # a multiple of VEC, known to the compiler: 16-byte accesses
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    dtype = x.dtype.element_ty
    epoch = tl.load(epochs + pid) + 1
    own = _rank_buffer(buffer_ptrs, rank, dtype)
    for start in range(pid * BLOCK, numel, step):
        offs = start + tl.arange(0, BLOCK)
        _stage(x, buffer_ptrs, own, numel, offs, offs < numel, dtype, rank, world, PUSH)
    if SYNC:
        _exchange(flag_ptrs, 0, pid, epoch, rank, world, max_programs)
    for start in range(pid * BLOCK, numel, step):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < numel
        tl.store(x + offs, _one_shot_sum(buffer_ptrs, own, numel, offs, ok, dtype, world, PUSH, BLOCK).to(dtype),
                 mask=ok)
    if SYNC:
        _exchange(flag_ptrs, 1, pid, epoch, rank, world, max_programs)
    tl.store(epochs + pid, epoch)


@triton.jit(do_not_specialize=["vectors"])
def _two_shot_kernel(x, buffer_ptrs, flag_ptrs, epochs, vectors, max_programs,
                     rank: tl.constexpr, world: tl.constexpr, SYNC: tl.constexpr, BLOCK: tl.constexpr):
    # The message in ``world`` segments of ``seg`` elements; rank r sums segment r (reduce-scatter), then
    # every rank reads the others' sums (all-gather). Program b: offsets [b * BLOCK + k * programs * BLOCK,
    # + BLOCK) within every segment, so the programs that exchange signals touch the same elements.
    numel = vectors * _VEC
    seg = tl.cdiv(vectors, world) * _VEC   # segments of whole vectors; the last may be short or empty
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    dtype = x.dtype.element_ty
    epoch = tl.load(epochs + pid) + 1
    own = _rank_buffer(buffer_ptrs, rank, dtype)
    for start in range(pid * BLOCK, seg, step):
        offs = start + tl.arange(0, BLOCK)
        for s in tl.static_range(world):
            at = s * seg + offs
            ok = (offs < seg) & (at < numel)
            tl.store(own + at, tl.load(x + at, mask=ok), mask=ok)
    if SYNC:
        _exchange(flag_ptrs, 0, pid, epoch, rank, world, max_programs)
    for start in range(pid * BLOCK, seg, step):
        offs = start + tl.arange(0, BLOCK)
        at = rank * seg + offs
        ok = (offs < seg) & (at < numel)
        total = _sum_over_ranks(buffer_ptrs, at, ok, dtype, world, BLOCK).to(dtype)
        tl.store(own + at, total, mask=ok)
        tl.store(x + at, total, mask=ok)
    if SYNC:
        _exchange(flag_ptrs, 1, pid, epoch, rank, world, max_programs)
    for start in range(pid * BLOCK, seg, step):
        offs = start + tl.arange(0, BLOCK)
        for peer in tl.static_range(world):
            if peer != rank:
                at = peer * seg + offs
                ok = (offs < seg) & (at < numel)
                buf = _rank_buffer(buffer_ptrs, peer, dtype)
                tl.store(x + at, tl.load(buf + at, mask=ok), mask=ok)
    if SYNC:
        _exchange(flag_ptrs, 2, pid, epoch, rank, world, max_programs)
    tl.store(epochs + pid, epoch)


# Rows vary per step: not specialised (one variant per model: HIDDEN is its hidden size).
@triton.jit(do_not_specialize=["rows"])
def _one_shot_add_kernel(x, residual, weight, y, s, buffer_ptrs, flag_ptrs, epochs, rows, max_programs, eps,
                         rank: tl.constexpr, world: tl.constexpr, SYNC: tl.constexpr, PUSH: tl.constexpr,
                         HAS_NORM: tl.constexpr, HIDDEN: tl.constexpr, BLOCK: tl.constexpr):
    # grid: (programs,); program b: rows b, b + programs, ... of HIDDEN contiguous elements each
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    dtype = x.dtype.element_ty
    epoch = tl.load(epochs + pid) + 1
    own = _rank_buffer(buffer_ptrs, rank, dtype)
    cols = tl.arange(0, BLOCK)
    ok = cols < HIDDEN
    numel = rows * HIDDEN                      # the push layout's slot stride
    for row in range(pid, rows, programs):
        offs = row * HIDDEN + cols             # < the staging buffer's elements: int32 is enough
        _stage(x, buffer_ptrs, own, numel, offs, ok, dtype, rank, world, PUSH)
    if SYNC:
        _exchange(flag_ptrs, 0, pid, epoch, rank, world, max_programs)
    for row in range(pid, rows, programs):
        offs = row * HIDDEN + cols
        total = _one_shot_sum(buffer_ptrs, own, numel, offs, ok, dtype, world, PUSH, BLOCK).to(dtype)  # the sum
        r = tl.load(residual + offs, mask=ok, other=0.0)
        sv = (total.to(tl.float32) + r.to(tl.float32)).to(dtype)                       # + residual, rounded
        tl.store(s + offs, sv, mask=ok)
        if HAS_NORM:                                   # radixrelay.kernels.rms_norm's arithmetic
            sf = sv.to(tl.float32)
            inv = tl.rsqrt(tl.sum(sf * sf, axis=0) / HIDDEN + eps)
            normed = (sf * inv).to(dtype)
            w = tl.load(weight + cols, mask=ok, other=0.0)
            tl.store(y + offs, (w.to(tl.float32) * normed.to(tl.float32)).to(dtype), mask=ok)
    if SYNC:
        _exchange(flag_ptrs, 1, pid, epoch, rank, world, max_programs)
    tl.store(epochs + pid, epoch)


def programs_for(numel: int, max_programs: int, block: int = BLOCK) -> int:
    """The grid of a call: one program per ``block`` elements, at most ``max_programs``."""
    return max(1, min(max_programs, triton.cdiv(numel, block)))


SLOTS = 3             # signals per call: two-shot's three (one-shot uses two)


def flag_count(world: int, max_programs: int) -> int:
    """int32 flags each rank's pad needs."""
    return SLOTS * max_programs * world


def peer_all_reduce(x: torch.Tensor, buffer_ptrs: torch.Tensor, flag_ptrs: torch.Tensor, epochs: torch.Tensor,
                    rank: int, world: int, max_programs: int, two_shot: bool = False,
                    sync: bool = True, block: int = BLOCK, push: bool = False) -> torch.Tensor:
    """See the module docstring. The caller guarantees the buffers hold ``x.numel()`` elements of its dtype,
    the flags ``flag_count(world, max_programs)`` int32 each, and ``epochs`` (this rank's, ``max_programs``
    int32, zero at first like the flags) is used by nothing else."""
    name = "peer_all_reduce"
    check(x.dtype in FLOAT_DTYPES, f"{name}: dtype {x.dtype} not supported (fp16, bf16, fp32)")
    check(x.is_contiguous(), f"{name}: x must be contiguous")
    check(0 <= rank < world, f"{name}: rank {rank} outside [0, {world})")
    check(world & (world - 1) == 0, f"{name}: {world} ranks; needs a power of two")
    check(buffer_ptrs.shape == (world,) and flag_ptrs.shape == (world,)
          and buffer_ptrs.dtype == flag_ptrs.dtype == torch.int64,
          f"{name}: buffer_ptrs and flag_ptrs must be [{world}] int64")
    check(epochs.dtype == torch.int32 and epochs.numel() >= max_programs, f"{name}: epochs must be "
          f">= {max_programs} int32")
    numel = x.numel()
    check(numel % VEC == 0, f"{name}: {numel} elements; needs a multiple of {VEC}")
    if numel:
        vectors = numel // VEC
        kernel, per_program = ((_two_shot_kernel, triton.cdiv(vectors, world) * VEC) if two_shot
                               else (_one_shot_kernel, numel))
        kernel[(programs_for(per_program, max_programs, block),)](
            x, buffer_ptrs, flag_ptrs, epochs, vectors, max_programs, rank=rank, world=world, SYNC=sync,
            BLOCK=block, num_warps=NUM_WARPS, **({} if two_shot else {"PUSH": push}))
    return x


MAX_HIDDEN = 16384     # ``peer_all_reduce_add``: a row is one tile


def peer_all_reduce_add(x: torch.Tensor, residual: torch.Tensor, buffer_ptrs: torch.Tensor, flag_ptrs: torch.Tensor,
                        epochs: torch.Tensor, rank: int, world: int, max_programs: int,
                        norm: tuple[torch.Tensor, float] | None = None, sync: bool = True, push: bool = False):
    """See the module docstring: s = (x summed over the ranks) + residual, or (RMSNorm(s), s) with
    ``norm`` = (weight [hidden], eps). ``x`` is left as it was. The caller guarantees what
    ``peer_all_reduce`` asks of the buffers, flags and epochs."""
    name = "peer_all_reduce_add"
    check(x.dim() == 2 and x.is_contiguous(), f"{name}: x must be a contiguous [rows, hidden], got shape "
          f"{tuple(x.shape)}")
    rows, hidden = x.shape
    check(x.dtype in FLOAT_DTYPES, f"{name}: dtype {x.dtype} not supported (fp16, bf16, fp32)")
    check(hidden % VEC == 0 and hidden <= MAX_HIDDEN, f"{name}: hidden {hidden}; needs a multiple of {VEC} "
          f"up to {MAX_HIDDEN}")
    check(residual.shape == x.shape and residual.dtype == x.dtype and residual.is_contiguous(),
          f"{name}: residual must be a contiguous {tuple(x.shape)} {x.dtype}, got {tuple(residual.shape)} "
          f"{residual.dtype}")
    check(0 <= rank < world and world & (world - 1) == 0, f"{name}: rank {rank} of {world} (a power of two)")
    check(buffer_ptrs.shape == (world,) and flag_ptrs.shape == (world,)
          and buffer_ptrs.dtype == flag_ptrs.dtype == torch.int64,
          f"{name}: buffer_ptrs and flag_ptrs must be [{world}] int64")
    check(epochs.dtype == torch.int32 and epochs.numel() >= max_programs, f"{name}: epochs must be "
          f">= {max_programs} int32")
    weight, eps = norm if norm is not None else (x, 0.0)
    if norm is not None:
        check(weight.shape == (hidden,) and weight.dtype == x.dtype and weight.is_contiguous(),
              f"{name}: norm weight must be a contiguous [{hidden}] {x.dtype}, got {tuple(weight.shape)} "
              f"{weight.dtype}")
    s = torch.empty_like(x)
    y = torch.empty_like(x) if norm is not None else s
    if rows:
        block = triton.next_power_of_2(hidden)
        _one_shot_add_kernel[(max(1, min(max_programs, rows)),)](
            x, residual, weight, y, s, buffer_ptrs, flag_ptrs, epochs, rows, max_programs, eps, rank=rank,
            world=world, SYNC=sync, PUSH=push, HAS_NORM=norm is not None, HIDDEN=hidden, BLOCK=block,
            num_warps=min(16, max(1, block // 512)))
    return s if norm is None else (y, s)


def all_reduce_reference(parts: list[torch.Tensor]) -> torch.Tensor:
    """The ranks' partial sums added in rank order in float64, rounded to their dtype."""
    return torch.stack([p.double() for p in parts]).sum(0).to(parts[0].dtype)
