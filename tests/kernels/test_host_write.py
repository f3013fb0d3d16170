"""kernels.host_write: a step's results written into pinned host memory by a kernel (no device-to-host copy).
Interpreter: the kernel between CPU tensors against its torch contract; GPU: values through pinned memory,
also while a large copy out of the device runs on another stream (the case it exists for)."""

from __future__ import annotations

import pytest
import torch

from radixrelay.kernels import host_write
from tests.kernels.helpers import DEVICE


@pytest.mark.parametrize("dtype", host_write.DTYPES)
@pytest.mark.parametrize("shape", [(1,), (7, 3), (2 * host_write.BLOCK + 5,)])
def test_launch_equals_the_reference(dtype, shape):
    gen = torch.Generator().manual_seed(sum(shape))
    src = (torch.randn(shape, generator=gen) * 1000).to(dtype)
    dst, want = torch.full(shape, -1, dtype=dtype), torch.full(shape, -1, dtype=dtype)
    host_write.launch(src, dst)
    host_write.write_reference(src, want)
    assert torch.equal(dst, want)


def test_refuses_what_it_cannot_write():
    with pytest.raises(ValueError, match="CUDA tensor"):
        host_write.write_to_host(torch.zeros(3, dtype=torch.int64))


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
def test_write_to_host_beside_a_large_copy_gpu():
    big = torch.ones(256 << 20, dtype=torch.uint8, device="cuda")
    host_big = torch.empty(big.shape, dtype=torch.uint8, pin_memory=True)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        host_big.copy_(big, non_blocking=True)
    tokens = torch.arange(300, device="cuda") * 3
    logprobs = torch.linspace(-5, 0, 12, device="cuda").view(3, 4)
    host_tokens, host_logprobs = host_write.write_to_host(tokens), host_write.write_to_host(logprobs.t())
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    assert host_tokens.is_pinned() and torch.equal(host_tokens, tokens.cpu())
    assert torch.equal(host_logprobs, logprobs.t().cpu())
    side.synchronize()
    assert bool((host_big == 1).all())
