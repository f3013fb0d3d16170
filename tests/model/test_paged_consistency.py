"""Extends, chunked extends and decodes through the paged cache equal one full forward pass."""

from __future__ import annotations

import pytest
import torch

from radixrelay.model import ModelConfig, load_model
from tests.model.paged import PagedSession

CFG = ModelConfig(architecture="qwen2", vocab_size=64, hidden_size=48, intermediate_size=80,
                  num_layers=2, num_heads=6, num_kv_heads=2, head_dim=8, attention_bias=True,
                  max_position_embeddings=256)


@pytest.fixture(scope="module")
def model():
    # float64 so that different batchings agree to ~1e-12, not float32 reduction noise.
    net, _ = load_model(CFG, dtype=torch.float64, seed=7)
    with torch.no_grad():  # dummy weights are small; scale up so attention is far from uniform
        for p in net.parameters():
            p.mul_(8.0 if p.dim() == 2 else 1.0)
    return net


def _sequences():
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, CFG.vocab_size, (n,), generator=gen).tolist() for n in (23, 9, 14)]


@pytest.mark.parametrize("page_size", [1, 4, 5])
def test_chunked_extend_and_decode_equal_full_forward(model, page_size):
    seqs = _sequences()
    full = PagedSession(model, num_pages=96, page_size=page_size, seed=0)
    for rid, s in enumerate(seqs):
        full.add(rid, s)
    # Reference: each sequence alone, one full extend, every row's logits.
    expected = {rid: full.step([(rid, len(s))], all_logits=True) for rid, s in enumerate(seqs)}

    # Same sequences, interleaved: request 0 in chunks 6 / 10 / 7 tokens; request 1 is prefilled
    # then decodes one token at a time; request 2 joins mid-way. Every step mixes kinds.
    paged = PagedSession(model, num_pages=96, page_size=page_size, seed=1)
    for rid, s in enumerate(seqs):
        paged.add(rid, s)
    plan = [
        [(0, 6), (1, 5)],
        [(1, 1), (0, 10)],
        [(0, 7), (1, 1), (2, 12)],
        [(1, 1), (2, 1)],
        [(1, 1), (2, 1)],
    ]
    got: dict[int, list[torch.Tensor]] = {0: [], 1: [], 2: []}
    for work in plan:
        logits = paged.step(work, all_logits=True)
        row = 0
        for rid, n in work:
            got[rid].append(logits[row:row + n])
            row += n
    for rid, s in enumerate(seqs):
        assert paged.done[rid] == len(s)
        torch.testing.assert_close(torch.cat(got[rid]), expected[rid], atol=1e-9, rtol=1e-9)


def test_last_token_logits_only(model):
    seqs = _sequences()
    session = PagedSession(model, num_pages=64, page_size=4)
    for rid, s in enumerate(seqs):
        session.add(rid, s)
    last = session.step([(rid, len(s)) for rid, s in enumerate(seqs)])
    assert last.shape == (3, CFG.vocab_size) and last.dtype == torch.float64
    other = PagedSession(model, num_pages=64, page_size=4)
    for rid, s in enumerate(seqs):
        other.add(rid, s)
    every = other.step([(rid, len(s)) for rid, s in enumerate(seqs)], all_logits=True)
    ends = torch.tensor([len(s) for s in seqs]).cumsum(0) - 1
    torch.testing.assert_close(last, every[ends], atol=1e-12, rtol=1e-12)


def test_forward_rejects_mismatched_input(model):
    session = PagedSession(model, num_pages=8, page_size=4)
    session.add(0, [1, 2, 3])
    session.tokens[0] = [1, 2]  # two ids for a three-token batch
    with pytest.raises(ValueError, match="input ids"):
        session.step([(0, 3)])


def test_each_layer_waits_for_its_tier_loads_before_storing_its_kv(model, monkeypatch):
    """KV tier loads land layer by layer (``KVCache.wait_for_layer``): layer l waits for them before it
    writes its new K/V (a page a load still writes may be one given to the step's new tokens) and before
    its attention reads the cache."""
    session = PagedSession(model, num_pages=16, page_size=4)
    order = []
    monkeypatch.setattr(session.cache, "wait_for_layer", lambda layer: order.append(("wait", layer)))
    store = session.cache.store
    monkeypatch.setattr(session.cache, "store", lambda layer, *a: (order.append(("store", layer)), store(layer, *a)))
    session.greedy({0: _sequences()[0]}, 2)
    per_forward = [x for layer in range(CFG.num_layers) for x in (("wait", layer), ("store", layer))]
    assert order == per_forward * 2
