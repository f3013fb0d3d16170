"""Attention for the worker: ragged batch metadata, paged KV cache, backends (torch reference here;
Triton kernels in ``radixrelay.kernels``). Conventions: docs/kv_layout.md."""

from radixrelay.attention.backend import AttentionBackend, LayerAttention, TorchBackend
from radixrelay.attention.kv_cache import KVCache
from radixrelay.attention.metadata import BatchRequest, ForwardBatch, build_forward_batch
from radixrelay.attention.reference import decode_reference, extend_reference, merge_states

__all__ = [
    "AttentionBackend",
    "BatchRequest",
    "ForwardBatch",
    "KVCache",
    "LayerAttention",
    "TorchBackend",
    "build_forward_batch",
    "decode_reference",
    "extend_reference",
    "merge_states",
]
