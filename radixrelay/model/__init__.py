"""The worker's model: config, the architecture registry (``architectures``: Llama, Mistral, Qwen2/3, Phi-3,
Gemma 2/3, Mixtral, Qwen3-MoE), the decoder they share (``llama``; routed experts in ``moe``), checkpoint
loading.

One step, end to end::

    model, cfg = load_model("default", device="cuda")            # bf16 on CUDA, fp32 on CPU
    cache = KVCache(num_layers=cfg.num_layers, num_pages=N, page_size=P,
                    num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                    dtype=torch.bfloat16, device="cuda")
    batch = build_forward_batch([BatchRequest(pages, start, num_new), ...], P, "cuda")
    logits = model(input_ids, batch, cache, TorchBackend())      # [R, vocab] float32

``input_ids`` holds each request's tokens ``[start, start + num_new)``, packed in request order.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixrelay.model.model_config import ModelConfig, RopeScaling
    from radixrelay.model.llama import LlamaForCausalLM
    from radixrelay.model.loader import load_model
    from radixrelay.model.model_registry import resolve_model_path

__all__ = ["LlamaForCausalLM", "ModelConfig", "RopeScaling", "load_model", "resolve_model_path"]

# Imported lazily: torch-free processes (scheduler, HTTP server) use ``model_registry`` and ``model_config``
# without paying for torch.
_HOMES = {
    "ModelConfig": "model_config", "RopeScaling": "model_config", "LlamaForCausalLM": "llama",
    "load_model": "loader", "resolve_model_path": "model_registry",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'radixrelay.model' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"radixrelay.model.{home}"), name)
