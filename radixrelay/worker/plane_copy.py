"""A block of rows copied in every plane of a pair of tensors by one 2-D copy (``cudaMemcpy2DAsync``).

The KV cache and the KV tiers' host pool are both ``[num_layers, 2 (K, V), rows, Hkv, D]`` allocations:
a run of pages is, in each of the ``2 * num_layers`` planes, one block of consecutive rows, and the
planes sit at a fixed pitch on either side. One 2-D copy moves the block of every plane (or of a few
layers' planes) as one copy-engine job. A copy per plane through torch costs the worker host time for
each launch: a 4K-token history loaded in runs of 16 pages was 1,024 copies, and the load ran at the rate
the worker could launch them, not at the bus's (``benchmarks/tiers/bench_tier_loads.py``;
benchmarks/results/tiers/tier_loads_h100_80gb_hbm3.md).

API::

    copy_planes(dst, src, stream) -> bool
        dst, src: [P, R, ...] of one shape and dtype, each plane's R rows contiguous (any plane pitch),
        one side CUDA and the other CUDA or pinned host memory. Queues the copy on ``stream`` (a
        ``torch.cuda.Stream``) and returns True; False, queuing nothing, where the CUDA runtime's entry
        point is not found in the process (the caller copies plane by plane).
"""

from __future__ import annotations

import ctypes
import math

import torch

_MEMCPY_DEFAULT = 4          # cudaMemcpyDefault: the direction from the pointers (unified addressing)
_entry: object = None        # the runtime's cudaMemcpy2DAsync once looked up (False: not found)


def copy_planes(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> bool:
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(f"copy_planes: {tuple(src.shape)} {src.dtype} into {tuple(dst.shape)} {dst.dtype}")
    if dst.dim() < 2:
        raise ValueError(f"copy_planes: tensors of [planes, rows, ...], got {dst.dim()} dimensions")
    if not (dst.is_cuda or src.is_cuda) or any(not x.is_cuda and not x.is_pinned() for x in (dst, src)):
        raise ValueError("copy_planes: one side on the device, the other on the device or in pinned host memory")
    if not dst.numel():
        return True
    row = math.prod(dst.shape[2:])
    for x in (dst, src):
        if x.shape[1] > 1 and x.stride(1) != row or not x[0, 0].is_contiguous():
            raise ValueError("copy_planes: each plane's rows must be contiguous")
    fn = _cudart_memcpy_2d()
    if fn is None:
        return False
    planes, size = dst.shape[0], dst.element_size()
    width = dst.shape[1] * row * size
    err = fn(dst.data_ptr(), dst.stride(0) * size, src.data_ptr(), src.stride(0) * size, width, planes,
             _MEMCPY_DEFAULT, stream.cuda_stream)
    if err:
        raise RuntimeError(f"cudaMemcpy2DAsync failed with CUDA error {err} ({planes} planes of {width} bytes)")
    return True


def _cudart_memcpy_2d():
    """The CUDA runtime library torch loaded (found in the process's mapped files), its
    ``cudaMemcpy2DAsync``: called directly, a copy costs a few microseconds of host time."""
    global _entry
    if _entry is None:
        _entry = _find() or False
    return _entry or None


def _find():
    try:
        with open("/proc/self/maps") as maps:
            paths = [line.split()[-1] for line in maps if "libcudart.so" in line]
    except OSError:
        return None
    for path in dict.fromkeys(paths):
        try:
            fn = ctypes.CDLL(path).cudaMemcpy2DAsync
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                       ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        return fn
    return None
