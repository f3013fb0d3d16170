"""plane_copy: a block of rows in every plane of two [planes, rows, ...] tensors by one 2-D copy. CPU: what
it refuses; GPU: both directions between pinned host memory and the device at different plane pitches
equal plane-by-plane copies, and the CUDA runtime's entry point is found (else the tiers fall back)."""

from __future__ import annotations

import pytest
import torch

from radixrelay.worker.plane_copy import copy_planes


def test_refuses_what_it_cannot_copy():
    a, b = torch.zeros(4, 3, 2), torch.zeros(4, 3, 2)
    with pytest.raises(ValueError, match="pinned host memory"):
        copy_planes(a, b, None)
    with pytest.raises(ValueError, match="into"):
        copy_planes(a, torch.zeros(4, 3, 3), None)
    with pytest.raises(ValueError, match="planes, rows"):
        copy_planes(torch.zeros(4), torch.zeros(4), None)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_rows_of_every_plane_both_ways_cuda(dtype):
    stream = torch.cuda.Stream()
    host = (torch.randn(3, 2, 40, 2, 8) * 4).to(dtype).pin_memory()      # [layers, K/V, rows, heads, dim]
    dev = torch.zeros(3, 2, 24, 2, 8, dtype=dtype, device="cuda")
    with torch.cuda.stream(stream):
        assert copy_planes(dev[:, :, 8:20].flatten(0, 1), host[:, :, 16:28].flatten(0, 1), stream)
    stream.synchronize()
    bits = (lambda t: t.view(torch.uint8)) if dtype.itemsize == 1 else (lambda t: t)
    assert torch.equal(bits(dev[:, :, 8:20].cpu()), bits(host[:, :, 16:28]))
    assert not bits(dev[:, :, :8]).any() and not bits(dev[:, :, 20:]).any()          # nothing else written
    back = torch.zeros(2, 2, 40, 2, 8, dtype=dtype).pin_memory()
    with torch.cuda.stream(stream):
        assert copy_planes(back[:, :, 4:16].flatten(0, 1), dev[1:, :, 8:20].flatten(0, 1), stream)
    stream.synchronize()
    assert torch.equal(bits(back[:, :, 4:16]), bits(host[1:, :, 16:28]))
