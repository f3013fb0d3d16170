"""Choosing an attention backend by name (the interface and the torch reference: ``backend.py``; the
Triton kernels: ``triton_backend.py``)."""

from __future__ import annotations

import torch

from radixrelay.attention.backend import AttentionBackend, TorchBackend


def make_backend(name: str, device: torch.device | str, node_kernel: str = "triton") -> AttentionBackend:
    """``triton`` (the kernels: CUDA, or the CPU under TRITON_INTERPRET=1) or ``torch`` (reference);
    ``node_kernel`` ("triton" or "fa3", resolved): the triton backend's kernel for shared decode nodes."""
    if name == "torch":
        return TorchBackend()
    if name == "triton":
        from radixrelay.attention.triton_backend import TritonBackend   # keeps triton out of torch-only use

        return TritonBackend(overlap=torch.device(device).type == "cuda", node_kernel=node_kernel)
    raise ValueError(f"attention backend must be triton or torch, got {name!r}")
