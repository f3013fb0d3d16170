"""kernels.host_copy: a step's results written into pinned host memory, and its inputs read from it, by a
kernel (no copy engine). Interpreter: the kernel between CPU tensors against its torch contract; GPU: values
through pinned memory, also while a large copy out of the device runs on another stream (the case it exists
for; the inputs' side in tests/attention/test_host_staging.py)."""

from __future__ import annotations

import pytest
import torch

from radixrelay.kernels import host_copy
from tests.kernels.helpers import DEVICE


@pytest.mark.parametrize("dtype", host_copy.DTYPES)
@pytest.mark.parametrize("shape", [(1,), (7, 3), (2 * host_copy.BLOCK + 5,)])
def test_launch_equals_the_reference(dtype, shape):
    gen = torch.Generator().manual_seed(sum(shape))
    src = (torch.randn(shape, generator=gen) * 1000).to(dtype)
    dst, want = torch.full(shape, -1, dtype=dtype), torch.full(shape, -1, dtype=dtype)
    host_copy.launch(src, dst)
    host_copy.write_reference(src, want)
    assert torch.equal(dst, want)


def test_refuses_what_it_cannot_write():
    with pytest.raises(ValueError, match="CUDA tensor"):
        host_copy.write_to_host(torch.zeros(3, dtype=torch.int64))


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
    host_tokens, host_logprobs = host_copy.write_to_host(tokens), host_copy.write_to_host(logprobs.t())
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    assert host_tokens.is_pinned() and torch.equal(host_tokens, tokens.cpu())
    assert torch.equal(host_logprobs, logprobs.t().cpu())
    side.synchronize()
    assert bool((host_big == 1).all())


def test_read_from_host_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="CUDA tensor"):
        host_copy.read_from_host(torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64))


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32, torch.bool, torch.int16])
def test_read_from_host_in_words_or_bytes_gpu(dtype):
    values = (torch.arange(-7, 4000) % 5).to(dtype)
    src = values.pin_memory()
    out = torch.empty_like(values, device="cuda")
    assert host_copy.read_from_host(src, out) is out
    assert torch.equal(out.cpu(), values)
    odd = torch.empty(5, dtype=torch.uint8, pin_memory=True).fill_(9)
    assert host_copy.read_from_host(odd, torch.empty(5, dtype=torch.uint8, device="cuda")).tolist() == [9] * 5
    with pytest.raises(ValueError, match="bytes into"):
        host_copy.read_from_host(src, torch.empty(3, dtype=dtype, device="cuda"))
