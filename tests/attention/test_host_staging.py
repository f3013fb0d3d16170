"""The pinned staging ring: uploads wrap around its segments many times, behind a busy device, and
every device tensor still holds what was uploaded (no copy reads bytes written after it was queued)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixrelay.attention import host_staging
from radixrelay.attention.metadata import to_device


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
