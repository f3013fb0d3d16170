"""Small tensors moved between pinned host memory and the device by a kernel, past the copy engines.

API::

    write_to_host(x) -> host      # x: a CUDA tensor of DTYPES (made contiguous); host: new, pinned, x's shape and
                                  # dtype, holding x's values once the current stream has passed this point
    read_from_host(src, out)      # src: pinned host bytes; out: a contiguous CUDA tensor of as many bytes, which
                                  # holds them once the current stream has passed this point

Why not ``x.to("cpu", non_blocking=True)`` or ``out.copy_(src, non_blocking=True)``: a copy engine serves
the copies of one direction in the order they were queued, whatever their streams. A step's few bytes
(its inputs up, its sampled tokens down) then wait behind a KV tier transfer of gigabytes queued on another
stream: a save of a prompt just computed (12K tokens: 1.5 GB), or a load of a history started beside the
steps in flight (``benchmarks/tiers/bench_copy_queue.py`` measures both:
benchmarks/results/tiers/copy_queue_h100_80gb_hbm3.md). Pinned host memory is
mapped into the device's address space (unified addressing), so a kernel on the step's own stream reads or
writes it directly.

``write_reference`` is the kernel's contract in torch; the interpreter's tests run the kernel between CPU
tensors (``launch``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
DTYPES = (torch.int64, torch.int32, torch.float32)      # what the worker reads back: token ids, logprobs
WORDS = (torch.int32, torch.uint8)                      # what read_from_host moves: 4-byte words, else bytes


# Sizes and addresses vary per step: nothing specialised (no variant compiled after ready; radixrelay.worker.warmup).
@triton.jit(do_not_specialize=["src", "dst", "n"])
def _copy_kernel(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=ok), mask=ok)


def write_to_host(x: torch.Tensor) -> torch.Tensor:
    """``x``'s values (CUDA) in a new pinned host tensor, written by a kernel queued on the current stream:
    read it once the stream has passed this point (an event recorded after it has completed)."""
    if x.device.type != "cuda":
        raise ValueError(f"write_to_host: a CUDA tensor, got one on {x.device}")
    if x.dtype not in DTYPES:
        raise ValueError(f"write_to_host: dtype {x.dtype} not supported ({', '.join(map(str, DTYPES))})")
    src = x.contiguous()
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    n = src.numel()
    if n:
        _copy_kernel[(triton.cdiv(n, BLOCK),)](src, host, n, BLOCK=BLOCK)
    return host


def read_from_host(src: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` (contiguous, CUDA) given ``src``'s bytes (contiguous, pinned host, as many bytes) by a kernel
    queued on the current stream; ``src`` must not be written again before the stream has passed this point.
    Returns ``out``."""
    if out.device.type != "cuda" or not out.is_contiguous():
        raise ValueError(f"read_from_host: a contiguous CUDA tensor to read into, got one on {out.device}")
    if src.device.type != "cpu" or not src.is_contiguous() or not src.is_pinned():
        raise ValueError("read_from_host: the source must be contiguous pinned host memory")
    nbytes = out.numel() * out.element_size()
    if src.numel() * src.element_size() != nbytes:
        raise ValueError(f"read_from_host: {src.numel() * src.element_size()} bytes into {nbytes}")
    return read_unchecked(src, out, nbytes)


def read_unchecked(src: torch.Tensor, out: torch.Tensor, nbytes: int) -> torch.Tensor:
    """``read_from_host`` for a caller that guarantees its conditions (``host_staging``'s pinned ring, on
    every step: no pinned-memory query per upload). Returns ``out``."""
    if nbytes:
        aligned = nbytes % 4 == 0 and src.data_ptr() % 4 == 0 and out.data_ptr() % 4 == 0
        word = torch.int32 if aligned else torch.uint8       # every int32/int64/float32 upload moves words
        n = nbytes // word.itemsize
        _copy_kernel[(triton.cdiv(n, BLOCK),)](_flat(src, word), _flat(out, word), n, BLOCK=BLOCK)
    return out


def _flat(x: torch.Tensor, word: torch.dtype) -> torch.Tensor:
    return x.reshape(-1).view(torch.uint8).view(word)


def write_reference(src: torch.Tensor, dst: torch.Tensor) -> None:
    """The kernel's contract: ``dst`` (flat, at least ``src.numel()`` elements) gets ``src``'s values in order."""
    dst.view(-1)[:src.numel()] = src.reshape(-1)


def launch(src: torch.Tensor, dst: torch.Tensor) -> None:
    """One launch of the kernel from ``src`` into ``dst`` (any tensors of one dtype; the interpreter's tests,
    the start-up warm-up)."""
    n = src.numel()
    _copy_kernel[(max(triton.cdiv(n, BLOCK), 1),)](src.contiguous(), dst, n, BLOCK=BLOCK)
