"""transformers' own implementation of the default model, as the reference for greedy outputs."""

from __future__ import annotations

import functools

import torch


@functools.cache
def _hf_model():
    """transformers' model from the default GGUF, once per test process. Its loader parses the file's
    metadata (the tokenizer's ~100k strings) once for the config and again for the weights, and builds
    gguf's tensor-name table once per module of the model: about two thirds of the load's CPU. Both are
    pure functions of their arguments, so they are memoized while it loads; the weights, their
    dequantization and the model are transformers'."""
    import gguf
    from transformers import AutoModelForCausalLM

    from radixrelay.model.model_registry import resolve_model_path

    path = resolve_model_path("default")
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=1)(reader)
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=1)(name_map)
    try:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map
    return model.eval()


def hf_greedy(prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    model = _hf_model()
    outs = []
    for ids in prompts:
        with torch.inference_mode():
            seq = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                 min_new_tokens=max_new_tokens, pad_token_id=0)
        outs.append(seq[0, len(ids):].tolist())
    return outs


def hf_prompt_logprobs(ids: list[int]) -> list[float]:
    """Natural-log probability of each prompt token after the first, given the ones before it."""
    with torch.inference_mode():
        logprobs = _hf_model()(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)   # [len, V]
    return logprobs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
