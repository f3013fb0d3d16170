"""Large page-locked host buffers (the host KV tier's pool), allocated in seconds rather than minutes.

``torch.empty(..., pin_memory=True)`` goes through ``cudaHostAlloc``, which faults in and locks the
buffer one 4 KiB page at a time on one thread: tens of seconds of a server's start-up for a tier of
tens of GiB. Here the buffer is an anonymous mapping advised for transparent huge pages (2 MiB pages
where the kernel allows them), faulted in by several threads at once, then registered with CUDA
(``cudaHostRegister``): an order of magnitude faster (benchmarks/results/HISTORY.md). Any step that
fails (no huge pages, registration refused) falls back to the plain allocation.

The mapping lives as long as the tensor (the tensor's storage references it); ``release`` unregisters
it before the mapping can go, as CUDA requires.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import threading
import weakref

import numpy as np
import torch

logger = logging.getLogger("radixrelay.worker")

_PAGE = 4096
MAX_THREADS = 16


def fault_in(buffer: np.ndarray, threads: int | None = None) -> None:
    """Write one zero per 4 KiB page of ``buffer`` (uint8, 1-D), ``threads`` ranges at once (numpy
    releases the GIL for the strided writes), so that the kernel backs every page before registration."""
    threads = threads or min(MAX_THREADS, os.cpu_count() or 1)
    step = -(-len(buffer) // threads)
    step = -(-step // _PAGE) * _PAGE                    # ranges start on page boundaries

    def work(lo: int) -> None:
        buffer[lo:lo + step:_PAGE] = 0

    workers = [threading.Thread(target=work, args=(lo,)) for lo in range(0, len(buffer), step)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def anonymous_buffer(nbytes: int) -> tuple[np.ndarray, mmap.mmap]:
    """A zeroed, faulted-in anonymous mapping of ``nbytes`` (uint8 view, mapping), advised for huge pages."""
    mapping = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:                                 # transparent huge pages off: 4 KiB pages
            pass
    view = np.frombuffer(mapping, dtype=np.uint8, count=nbytes)
    fault_in(view)
    return view, mapping


_REGISTERED: set[int] = set()          # data pointers of the buffers ``pinned_empty`` registered


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A page-locked host tensor of ``shape`` (contents undefined, as ``torch.empty``) for copies to and
    from CUDA devices; see the module docstring. Give it back with ``release``."""
    nbytes = math.prod(shape) * dtype.itemsize
    cudart = torch.cuda.cudart()
    try:
        view, _ = anonymous_buffer(nbytes)
        err = cudart.cudaHostRegister(view.ctypes.data, nbytes, 0)
        if int(err) != 0:
            cudart.cudaGetLastError()       # a failed call leaves its error pending for the next launch
            raise RuntimeError(f"cudaHostRegister: {err}")
    except (OSError, RuntimeError, ValueError) as exc:
        logger.warning("pinned host memory: fast path failed (%s), allocating through cudaHostAlloc", exc)
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    tensor = torch.from_numpy(view).view(dtype).view(shape)   # keeps ``view`` (and the mapping) alive
    _REGISTERED.add(tensor.data_ptr())
    # A buffer dropped without ``release`` is unregistered when ``view`` goes: numpy clears an array's weak
    # references before it lets go of the mapping, so the range is never unmapped while registered (a
    # registered range left behind makes a later registration at the same address fail).
    weakref.finalize(view, _unregister, tensor.data_ptr())
    return tensor


def release(tensor: torch.Tensor) -> None:
    """Unregister a ``pinned_empty`` buffer from CUDA before it can be unmapped (a no-op for one that took
    the fallback, or released already)."""
    _unregister(tensor.data_ptr())


def _unregister(ptr: int) -> None:
    if ptr in _REGISTERED:
        _REGISTERED.discard(ptr)
        torch.cuda.cudart().cudaHostUnregister(ptr)
