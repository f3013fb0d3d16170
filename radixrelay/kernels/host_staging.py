"""Host-to-device copies of small host arrays through a reused ring of pinned memory.

A step uploads a handful of small arrays (positions, slots, page-table writes, indices). Pinning each
one (``Tensor.pin_memory()``: a caching host allocation, a copy and a stream record) costs tens of
microseconds of host time on top of the copy's own launch, and a step of a changed batch made several. Here
every upload is written into a ring of pinned memory that is allocated once, and read into the device by
one kernel on the stream (``kernels.host_copy``), not by a copy: the host-to-device copy engine serves its
copies in the order they were queued, and a KV tier load of hundreds of MB runs beside the steps, so a
step's inputs copied after it would wait for all of it. Uploads larger than a segment (rare: over 1 MiB)
take the allocator's path and a copy.

Reuse rule (why no copy reads overwritten bytes): the ring is cut into ``SEGMENTS`` segments. When
uploads move on from a segment, an event is recorded on the stream; a segment is written again only
after the event recorded when it was last left has completed, and that event follows, in stream order,
every read made from the segment. One ring per (device, stream): the event must follow the reads on
their own stream.
"""

from __future__ import annotations

import numpy as np
import torch

SEGMENT_BYTES = 1 << 20
SEGMENTS = 8
_ALIGN = 64


class PinnedRing:
    """Round-robin pinned staging for one CUDA stream (see the module docstring)."""

    def __init__(self, device: torch.device, stream: torch.cuda.Stream) -> None:
        self.device, self.stream = device, stream
        self._buf = torch.empty(SEGMENT_BYTES * SEGMENTS, dtype=torch.uint8, pin_memory=True)
        self._host = self._buf.numpy()                  # the same bytes, written from numpy
        self._segment = 0
        self._offset = 0                                # next free byte in the current segment
        self._left: list[torch.cuda.Event | None] = [None] * SEGMENTS   # recorded when each was last left

    def upload(self, data: np.ndarray, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        """``data`` (a 1-D numpy array of ``dtype``'s item size) copied without waiting for the device, into
        ``out`` (contiguous, as many elements of ``dtype``) or a new device tensor."""
        raw = data.view(np.uint8)
        n = raw.nbytes
        if n > SEGMENT_BYTES:
            staged = torch.from_numpy(data).view(dtype).pin_memory()
            return staged.to(self.device, non_blocking=True) if out is None else out.copy_(staged, non_blocking=True)
        if self._offset + n > SEGMENT_BYTES:
            self._advance()
        start = self._segment * SEGMENT_BYTES + self._offset
        self._host[start:start + n] = raw
        self._offset += -(-n // _ALIGN) * _ALIGN
        if out is None:
            out = torch.empty(n // dtype.itemsize, dtype=dtype, device=self.device)
        elif out.numel() * out.element_size() != n or not out.is_contiguous():
            raise ValueError(f"upload: {n} bytes into a tensor of {out.numel() * out.element_size()} bytes "
                             f"({'' if out.is_contiguous() else 'not '}contiguous)")
        from radixrelay.kernels.host_copy import read_unchecked      # imports triton: CUDA only

        return read_unchecked(self._buf[start:start + n], out, n)    # pinned, n bytes each side

    def _advance(self) -> None:
        event = torch.cuda.Event()
        event.record(self.stream)
        self._left[self._segment] = event
        self._segment = (self._segment + 1) % SEGMENTS
        self._offset = 0
        waiting = self._left[self._segment]
        if waiting is not None:
            waiting.synchronize()                       # long done in practice: SEGMENTS - 1 segments ago


_RINGS: dict[tuple[int, int], PinnedRing] = {}     # (device index, raw stream handle) -> ring


def upload(data: np.ndarray, dtype: torch.dtype, device: torch.device, out: torch.Tensor | None = None) -> torch.Tensor:
    """``data`` on CUDA ``device`` (into ``out`` if given) through the current stream's ring (created on
    first use). The ring is found by the raw stream handle (one C call; ``torch.cuda.current_stream``
    builds a Python stream object, tens of microseconds on some hosts, and a step makes several uploads)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, _raw_stream(index))
    ring = _RINGS.get(key)
    if ring is None:
        ring = _RINGS[key] = PinnedRing(torch.device("cuda", index), torch.cuda.current_stream(index))
    return ring.upload(data, dtype, out)


def tensor_to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor (any shape; made contiguous) on ``device``: through the current stream's ring on CUDA
    (never behind a tier transfer's copies), else ``Tensor.to``."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    if not t.numel():
        return torch.empty(t.shape, dtype=t.dtype, device=device)
    flat = t.contiguous().reshape(-1).view(torch.uint8).numpy()
    return upload(flat, torch.uint8, device).view(t.dtype).view(t.shape)


def _raw_stream(index: int) -> int:
    return torch._C._cuda_getCurrentRawStream(index)
