"""A small device tensor written into pinned host memory by a kernel: a step's results reach the host without
a device-to-host copy.

API::

    write_to_host(x) -> host      # x: a CUDA tensor of DTYPES (made contiguous); host: new, pinned, x's shape and
                                  # dtype, holding x's values once the current stream has passed this point

Why not ``x.to("cpu", non_blocking=True)``: the copy engine serves device-to-host copies in the order they
were queued, whatever their streams, so a step's few bytes of sampled tokens wait behind a KV tier save of
gigabytes queued on another stream (a prompt of 12K tokens just computed: 1.5 GB, ~30-60 ms). Pinned host
memory is mapped into the device's address space (unified addressing), so a kernel on the step's own stream
stores the values there directly, past the copy queue.

``write_reference`` is the kernel's contract in torch; the interpreter's tests run the kernel between CPU
tensors (``launch``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
DTYPES = (torch.int64, torch.int32, torch.float32)      # what the worker reads back: token ids, logprobs


# Sizes and addresses vary per step: nothing specialised (no variant compiled after ready; radixrelay.worker.warmup).
@triton.jit(do_not_specialize=["src", "dst", "n"])
def _write_kernel(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=ok), mask=ok)


def write_to_host(x: torch.Tensor) -> torch.Tensor:
    """``x``'s values (CUDA) in a new pinned host tensor, written by a kernel queued on the current stream:
    read it once the stream has passed this point (an event recorded after it has completed)."""
    if x.device.type != "cuda":
        raise ValueError(f"write_to_host: a CUDA tensor, got one on {x.device}")
    if x.dtype not in DTYPES:
        raise ValueError(f"to_host: dtype {x.dtype} not supported ({', '.join(map(str, DTYPES))})")
    src = x.contiguous()
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    n = src.numel()
    if n:
        _write_kernel[(triton.cdiv(n, BLOCK),)](src, host, n, BLOCK=BLOCK)
    return host


def write_reference(src: torch.Tensor, dst: torch.Tensor) -> None:
    """The kernel's contract: ``dst`` (flat, at least ``src.numel()`` elements) gets ``src``'s values in order."""
    dst.view(-1)[:src.numel()] = src.reshape(-1)


def launch(src: torch.Tensor, dst: torch.Tensor) -> None:
    """One launch of the kernel from ``src`` into ``dst`` (any tensors of one dtype; the interpreter's tests,
    the start-up warm-up)."""
    n = src.numel()
    _write_kernel[(max(triton.cdiv(n, BLOCK), 1),)](src.contiguous(), dst, n, BLOCK=BLOCK)
