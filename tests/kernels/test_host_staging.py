"""The pinned staging ring: uploads wrap around its segments many times, behind a busy device, and
every device tensor still holds what was uploaded (no copy reads bytes written after it was queued)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixrelay.attention.metadata import to_device
from radixrelay.kernels import host_staging


@pytest.mark.gpu
def test_uploads_survive_ring_reuse_behind_a_busy_device():
    device = torch.device("cuda")
    rng = np.random.default_rng(0)
    a = torch.randn(4096, 4096, device=device)
    kept = []
    total = 0
    while total < 3 * host_staging.SEGMENT_BYTES * host_staging.SEGMENTS:   # wraps the ring three times
        a = a @ a / 64                                     # keeps the stream busy: copies queue behind it
        data = rng.integers(-2**40, 2**40, size=int(rng.integers(1, 40_000)), dtype=np.int64)
        kept.append((data, host_staging.upload(data, torch.int64, device)))
        total += data.nbytes
    big = rng.integers(0, 1000, size=host_staging.SEGMENT_BYTES // 4 + 1, dtype=np.int32)   # past a segment
    kept.append((big, host_staging.upload(big, torch.int32, device)))
    out = torch.empty(7, dtype=torch.int32, device=device)
    small = np.arange(7, dtype=np.int32)
    assert host_staging.upload(small, torch.int32, device, out=out) is out
    kept.append((small, out))
    torch.cuda.synchronize()
    for data, got in kept:
        assert np.array_equal(got.cpu().numpy(), data)


@pytest.mark.gpu
def test_to_device_keeps_values_and_dtypes():
    for values, dtype in (([1, -2, 3], torch.int64), ([5, 6], torch.int32), ([0.5, 2.0], torch.float32),
                          ([True, False, True], torch.bool)):
        got = to_device(values, dtype, "cuda")
        assert got.dtype == dtype and got.device.type == "cuda" and got.cpu().tolist() == values


@pytest.mark.gpu
def test_uploads_pass_a_large_load_queued_before_them():
    """A KV tier load (hundreds of MB host -> device on its own stream) runs beside the steps: a step's
    inputs uploaded after it do not wait for it (a copy would: one copy engine, served in queue order)."""
    device = torch.device("cuda")
    host_big = torch.ones(512 << 20, dtype=torch.uint8, pin_memory=True)
    big = torch.empty(host_big.shape, dtype=torch.uint8, device=device)
    side, loaded = torch.cuda.Stream(), torch.cuda.Event()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        big.copy_(host_big, non_blocking=True)
        loaded.record(side)
    uploaded = torch.cuda.Event()
    ids = to_device(list(range(1000)), torch.int64, device)
    flags = to_device([True, False, True], torch.bool, device)              # bytes, not words
    uploaded.record()
    uploaded.synchronize()
    assert not loaded.query()                                              # the load still runs
    assert ids.tolist() == list(range(1000)) and flags.tolist() == [True, False, True]
    side.synchronize()
    assert bool((big == 1).all())


@pytest.mark.gpu
def test_tensor_to_device_keeps_shape_dtype_and_values():
    for t in (torch.arange(12, dtype=torch.int64).view(3, 4), torch.rand(5, 3).t(), torch.zeros(0, 2),
              torch.tensor([[True, False]]), torch.arange(7, dtype=torch.int16)):
        got = host_staging.tensor_to_device(t, "cuda")
        assert got.device.type == "cuda" and got.dtype == t.dtype and got.shape == t.shape
        assert torch.equal(got.cpu(), t)


def test_tensor_to_device_on_the_cpu_is_to():
    t = torch.arange(6).view(2, 3)
    assert torch.equal(host_staging.tensor_to_device(t, "cpu"), t)


@pytest.mark.gpu
def test_upload_refuses_an_out_of_another_size():
    with pytest.raises(ValueError, match="8 bytes into a tensor of 12 bytes"):
        host_staging.upload(np.arange(2, dtype=np.int32), torch.int32, torch.device("cuda"),
                            out=torch.empty(3, dtype=torch.int32, device="cuda"))
