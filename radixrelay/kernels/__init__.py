"""Triton attention kernels for cascaded decode over a radix tree, each with its pure-torch reference.

All of them read the paged KV cache of docs/kv_layout.md and return ``(o, lse)`` with a float32,
natural-log LSE (``-inf`` for a row that attended nothing), so that partial results merge exactly:

- ``shared_node_attention``: the queries of many requests against one radix node's KV (cascade level);
- ``paged_decode_attention``: each request against its own range of its page list (split-K);
- ``extend_attention``: ragged new tokens against their cached prefix and themselves, causal;
- ``merge_attention_states``: any number of partial ``(o, lse)`` per row, in one launch;
- ``cascade_decode_attention``: shared nodes + own KV + one merge of all their splits (``plan_cascade``
  once per step; ``worth_cascading`` says when a node earns its level).

The launch wrappers check shapes, dtypes, devices and strides (ValueError), but not the values inside
index tensors (that would need a device sync): out-of-range page ids or request indices are undefined
behaviour, as are index tensors that disagree with each other (e.g. q_indptr[-1] != len(q_rows)).
Each module also has a ``*_reference`` in pure torch (float64 by default, CPU or GPU).
"""

from radixrelay.kernels.cascade_decode import (CascadePlan, cascade_decode_attention, cascade_decode_attention_reference,
                                        plan_cascade, worth_cascading)
from radixrelay.kernels.extend import extend_attention, extend_attention_reference
from radixrelay.kernels.merge import merge_attention_states, merge_attention_states_reference
from radixrelay.kernels.paged_decode import paged_decode_attention, paged_decode_attention_reference
from radixrelay.kernels.shared_node import shared_node_attention, shared_node_attention_reference

__all__ = [
    "CascadePlan",
    "cascade_decode_attention",
    "cascade_decode_attention_reference",
    "extend_attention",
    "extend_attention_reference",
    "merge_attention_states",
    "merge_attention_states_reference",
    "paged_decode_attention",
    "paged_decode_attention_reference",
    "plan_cascade",
    "worth_cascading",
    "shared_node_attention",
    "shared_node_attention_reference",
]
