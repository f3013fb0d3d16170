"""Large pinned host buffers (``radixrelay.worker.host_memory``): the mapping is faulted in by several
threads and zeroed; on CUDA it is registered (pinned), copies to and from the device round-trip, and it
is unregistered on release."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixrelay.worker import host_memory
from radixrelay.worker.host_memory import anonymous_buffer, fault_in, pinned_empty, release


@pytest.mark.parametrize("threads", [1, 3, 16])
def test_fault_in_writes_every_page_of_every_range(threads):
    buf = np.full(10 * 4096 + 123, 7, dtype=np.uint8)          # ragged tail: the last range is short
    fault_in(buf, threads)
    touched = np.flatnonzero(buf == 0)
    assert list(touched) == list(range(0, len(buf), 4096))      # page starts only, none missed


def test_anonymous_buffer_is_zeroed_and_writable():
    view, mapping = anonymous_buffer(3 * 4096 + 5)
    assert view.dtype == np.uint8 and len(view) == 3 * 4096 + 5 and not view.any()
    view[-1] = 9
    assert mapping[len(view) - 1] == 9


def test_release_of_a_plain_tensor_is_a_no_op():
    registered = set(host_memory._REGISTERED)
    release(torch.empty(4))             # never registered: nothing to unregister, no CUDA call
    assert host_memory._REGISTERED == registered


@pytest.mark.gpu
def test_pinned_buffer_round_trips_through_the_device():
    host = pinned_empty((4, 1024, 8), torch.bfloat16)
    assert host.is_pinned() and host.shape == (4, 1024, 8) and host.dtype == torch.bfloat16
    assert host.data_ptr() in host_memory._REGISTERED
    src = torch.randn(4, 1024, 8, device="cuda").to(torch.bfloat16)
    host.copy_(src, non_blocking=True)
    back = torch.empty_like(src)
    back.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, src)
    release(host)
    assert host.data_ptr() not in host_memory._REGISTERED
