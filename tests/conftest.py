"""Suite-wide settings: CPU machines run Triton kernels in the interpreter and skip GPU tests."""

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.runtime.server_process import short_temp_dir, tiny_model_args, write_tiny_model


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
    # Files with a slow test run first (the order is otherwise kept, and scripts/test.sh keeps xdist
    # from reordering files): spread over the workers, the long files start early instead of ending
    # the run alone.
    slow_files = {item.path for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: item.path not in slow_files)
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device; run with -m gpu on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A private temporary directory with a short path, for tests that give it to the runtime as its
    temporary directory and check the socket directory there (``short_temp_dir``)."""
    path = short_temp_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny dummy model's directory (``tests.runtime.server_process.TINY_MODEL_CONFIG``): an Engine's
    ``model``, with ``TINY_ENGINE``'s arguments."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir: Path) -> tuple[str, ...]:
    """``radixrelay serve`` arguments for the tiny dummy model (``tests.runtime.server_process.tiny_model_args``)."""
    return tiny_model_args(tiny_model_dir)
