"""Suite-wide settings: CPU machines run Triton kernels in the interpreter and skip GPU tests."""

import os

import pytest


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


HAS_CUDA = _cuda_available()
if not HAS_CUDA:
    # Must be set before triton is first imported anywhere in the test session.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device; run with -m gpu on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
