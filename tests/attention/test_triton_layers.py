"""TritonBackend over the layers of a step: what the first layer binds (sizes, buffers, launches) serves the
others, and every layer's result is bit-identical to a fresh backend's for the same inputs (no state leaks
between layers or steps). Mixed extend + decode batches, flat and cascaded (decode groups and prefill
shared runs); fp32, in the CPU interpreter or on a GPU (where later layers launch the compiled kernels
directly)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from radixrelay.attention import KVCache
from radixrelay.attention.triton_backend import TritonBackend
from tests.cascade.trees import batch_on, random_scenario
from tests.kernels.helpers import DEVICE

NUM_LAYERS = 2                 # the first binds, the second reuses what it bound
HEADS, HEAD_DIM = (4, 2), 16


def _scenario(seed: int):
    """A scenario whose cascaded batch has extend and decode rows, decode groups and prefill shared runs."""
    for attempt in range(200):
        sc = random_scenario(random.Random(seed * 1000 + attempt), page_size=2, num_extends=2, num_decodes=3,
                             dtype=torch.float32, heads=HEADS, head_dim=HEAD_DIM)
        c = sc.cascaded.cascade
        if c.decode is not None and c.prefill is not None:
            return dataclasses.replace(sc, flat=batch_on(sc.flat, DEVICE), cascaded=batch_on(sc.cascaded, DEVICE))
    raise AssertionError("no scenario with both kinds of shared runs")


def _layers_cache(sc, seed: int) -> KVCache:
    """The scenario's cache shape, NUM_LAYERS layers of different random K/V."""
    k0 = sc.cache.k[0]
    cache = KVCache(num_layers=NUM_LAYERS, num_pages=sc.cache.num_pages, page_size=sc.cache.page_size,
                    num_kv_heads=k0.shape[1], head_dim=k0.shape[2], dtype=torch.float32, device=DEVICE)
    gen = torch.Generator().manual_seed(seed)
    for t in cache.k + cache.v:
        t.copy_(torch.randn(t.shape, generator=gen))                     # (CPU generator: same values)
    return cache


def _queries(batch, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch.num_tokens, HEADS[0], HEAD_DIM, generator=gen).to(DEVICE) for _ in range(NUM_LAYERS)]


def _fresh(q, layer, cache, batch):
    return TritonBackend().forward_with_lse(q, layer, cache, batch)


def test_layers_and_steps_equal_a_fresh_backend():
    sc = _scenario(0)
    cache = _layers_cache(sc, 0)
    backend = TritonBackend()
    for step, batch in enumerate((sc.cascaded, sc.flat, sc.cascaded)):   # steps: a new batch each time
        qs = _queries(batch, step)
        got = [backend.forward_with_lse(q, layer, cache, batch) for layer, q in enumerate(qs)]
        assert backend._step.layers is not None                          # bound once, reused
        for layer, (q, (o, lse)) in enumerate(zip(qs, got)):             # later layers left earlier outputs alone
            want_o, want_lse = _fresh(q, layer, cache, batch)
            assert torch.equal(o, want_o), f"step {step} layer {layer}: o differs"
            assert torch.equal(lse, want_lse), f"step {step} layer {layer}: lse differs"


@pytest.mark.parametrize("cascaded", [False, True])
def test_out_buffers(cascaded):
    """``out=``: every layer writes the caller's buffers (one q and one o buffer for all layers, as piecewise
    graphs pass them), with the same values; ``forward(out=o)`` too."""
    sc = _scenario(2)
    batch = sc.cascaded if cascaded else sc.flat
    cache = _layers_cache(sc, 2)
    backend = TritonBackend()
    q_buf = torch.empty(batch.num_tokens, HEADS[0], HEAD_DIM, device=DEVICE)
    o_buf = torch.full_like(q_buf, float("nan"))
    lse_buf = torch.full(q_buf.shape[:2], float("nan"), device=DEVICE)
    for layer, q in enumerate(_queries(batch, 5)):
        q_buf.copy_(q)
        want_o, want_lse = _fresh(q, layer, cache, batch)
        if layer % 2:
            o_buf.fill_(float("nan"))
            assert backend.forward(q_buf, layer, cache, batch, out=o_buf) is o_buf
        else:
            o, lse = backend.forward_with_lse(q_buf, layer, cache, batch, out=(o_buf, lse_buf))
            assert o is o_buf and lse is lse_buf
            assert torch.equal(lse_buf, want_lse)
        assert torch.equal(o_buf, want_o)


def test_new_layout_binds_again():
    """A layer whose q has other strides than the first layer's is bound again (not launched with stale
    strides)."""
    sc = _scenario(3)
    batch, cache = sc.cascaded, _layers_cache(sc, 3)
    backend = TritonBackend()
    qs = _queries(batch, 7)
    backend.forward_with_lse(qs[0], 0, cache, batch)
    first = backend._step.layers
    wide = torch.zeros(batch.num_tokens, HEADS[0], 2 * HEAD_DIM, device=DEVICE)
    wide[..., :HEAD_DIM] = qs[1]
    q = wide[..., :HEAD_DIM]                                              # same values, other strides
    o, lse = backend.forward_with_lse(q, 1, cache, batch)
    assert backend._step.layers is not first
    want_o, want_lse = _fresh(qs[1], 1, cache, batch)
    assert torch.equal(o, want_o) and torch.equal(lse, want_lse)
