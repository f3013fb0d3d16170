"""Session-wide fixtures: the default GGUF model loaded once by us and once by transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixrelay.model import LlamaForCausalLM, ModelConfig, load_model, resolve_model_path


@pytest.fixture(autouse=True, scope="package")
def single_thread():
    """Small-batch CPU matmuls are memory bound; a second intra-op thread on a shared 2-core
    machine made them ~20x slower (thread handoff under contention). Restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    return resolve_model_path("default")


@pytest.fixture(scope="session")
def ours(default_gguf: Path) -> tuple[LlamaForCausalLM, ModelConfig]:
    return load_model(str(default_gguf), device="cpu", dtype=torch.float32)


@pytest.fixture(scope="session")
def prompts(default_gguf: Path) -> list[list[int]]:
    """Token ids of a few chat prompts, from transformers' tokenizer for the same GGUF file."""
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)
    texts = ["What is the capital of France?",
             "Write a short poem about the sea.",
             "Explain what a hash table is, step by step."]
    return [list(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False))
            for t in texts]
