"""The torch reference attention against a float64 direct computation, window merging, and the
ragged batch builder."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from radixrelay.attention import (
    BatchRequest,
    LayerAttention,
    KVCache,
    TorchBackend,
    build_forward_batch,
    decode_reference,
    extend_reference,
    merge_states,
)

PAGE = 4
HQ, HKV, D = 6, 2, 8


def _random_case(prefixes: list[int], news: list[int], seed: int = 0):
    """Random cache with non-contiguous pages; returns q, caches, page lists, batch tensors."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-(p + n) // PAGE) for p, n in zip(prefixes, news)) + 3
    perm = torch.randperm(num_pages, generator=gen).tolist()
    pages, at = [], 0
    for p, n in zip(prefixes, news):
        need = -(-(p + n) // PAGE)
        pages.append(perm[at:at + need])
        at += need
    k = torch.randn(num_pages * PAGE, HKV, D, generator=gen)
    v = torch.randn(num_pages * PAGE, HKV, D, generator=gen)
    q = torch.randn(sum(news), HQ, D, generator=gen)
    batch = build_forward_batch(
        [BatchRequest(pg, p, n) for pg, p, n in zip(pages, prefixes, news)], PAGE, "cpu")
    return q, k, v, pages, batch


def _direct(q, k, v, pages, prefixes, news, kv_start=None, kv_end=None, window=None, softcap=None, scale=D ** -0.5):
    """float64, one query row at a time, straight from the definitions in docs/kv_layout.md; ``window``:
    the last ``window`` positions only; ``softcap``: scores s -> softcap * tanh(s / softcap)."""
    o = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float64)
    row = 0
    for b, (pg, p, n) in enumerate(zip(pages, prefixes, news)):
        lo = 0 if kv_start is None else kv_start[b]
        hi = p + n if kv_end is None else kv_end[b]
        for i in range(n):
            pos = range(lo if window is None else max(lo, p + i + 1 - window), min(hi, p + i + 1))
            if len(pos):
                slots = torch.tensor([pg[t // PAGE] * PAGE + t % PAGE for t in pos])
                for h in range(HQ):
                    kh = k[slots, h // (HQ // HKV)].double()
                    vh = v[slots, h // (HQ // HKV)].double()
                    s = kh @ q[row, h].double() * scale
                    if softcap is not None:
                        s = torch.tanh(s / softcap) * softcap
                    lse[row, h] = torch.logsumexp(s, 0)
                    o[row, h] = torch.softmax(s, 0) @ vh
            row += 1
    return o, lse


PREFIXES, NEWS = [0, 5, 9, 3], [7, 1, 4, 1]  # a fresh extend, a decode, a chunk, a decode


def test_extend_matches_float64_direct():
    q, k, v, pages, batch = _random_case(PREFIXES, NEWS)
    o, lse = extend_reference(q, k, v, batch.page_table, PAGE, batch.q_indptr, batch.prefix_lens)
    o_ref, lse_ref = _direct(q, k, v, pages, PREFIXES, NEWS)
    assert o.dtype == torch.float32 and lse.dtype == torch.float32 and lse.shape == (sum(NEWS), HQ)
    torch.testing.assert_close(lse.double(), lse_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(o.double(), o_ref, atol=1e-5, rtol=1e-5)


def test_float64_inputs_compute_in_float64():
    q, k, v, pages, batch = _random_case(PREFIXES, NEWS, seed=1)
    o, lse = extend_reference(q.double(), k.double(), v.double(), batch.page_table, PAGE,
                              batch.q_indptr, batch.prefix_lens)
    o_ref, lse_ref = _direct(q, k, v, pages, PREFIXES, NEWS)
    assert lse.dtype == torch.float64
    torch.testing.assert_close(lse, lse_ref, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(o, o_ref, atol=1e-12, rtol=1e-12)


def test_decode_reference_is_one_token_extend():
    q, k, v, pages, batch = _random_case([5, 0, 12], [1, 1, 1], seed=2)
    o, lse = decode_reference(q, k, v, batch.page_table, PAGE, batch.seq_lens)
    o_ref, lse_ref = _direct(q, k, v, pages, [5, 0, 12], [1, 1, 1])
    torch.testing.assert_close(lse.double(), lse_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(o.double(), o_ref, atol=1e-5, rtol=1e-5)


def test_windows_merge_to_full_attention_and_empty_windows_are_neutral():
    q, k, v, pages, batch = _random_case(PREFIXES, NEWS, seed=3)
    args = (q, k, v, batch.page_table, PAGE, batch.q_indptr, batch.prefix_lens)
    split = torch.tensor([0, 4, 8, 2], dtype=torch.int32)  # request 0: shared part is empty
    o1, l1 = extend_reference(*args, kv_end=split)
    o2, l2 = extend_reference(*args, kv_start=split)
    o1_ref, l1_ref = _direct(q, k, v, pages, PREFIXES, NEWS, kv_end=split.tolist())
    torch.testing.assert_close(l1.double(), l1_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(o1.double(), o1_ref, atol=1e-5, rtol=1e-5)
    assert torch.isneginf(l1[: NEWS[0]]).all() and (o1[: NEWS[0]] == 0).all()

    o, lse = merge_states(o1, l1, o2, l2)
    o_full, lse_full = extend_reference(*args)
    assert not o.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(lse, lse_full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(o, o_full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("consecutive", [False, True])
def test_windows_of_whole_pages_before_their_queries_need_no_mask(consecutive):
    """A window of whole pages that ends before its queries (a long cached prefix read as a run of its own)
    plans without a mask, and one request's consecutive pages are read as a view of the cache: the same
    result as the direct computation either way."""
    from radixrelay.attention.reference import plan_attention

    q, k, v, pages, batch = _random_case([12], [3], seed=6)
    if consecutive:
        pages = [list(range(2, 2 + len(pages[0])))]
        batch = build_forward_batch([BatchRequest(pages[0], 12, 3)], PAGE, "cpu")
    window = torch.tensor([12], dtype=torch.int32)                  # [0, 12): three whole pages
    plan = plan_attention(batch.page_table, PAGE, batch.q_indptr, batch.prefix_lens, kv_end=window)
    assert plan.mask is None and plan.bias(3, torch.float32) is None
    assert plan.consecutive_from == (2 if consecutive else None)
    o, lse = extend_reference(q, k, v, batch.page_table, PAGE, batch.q_indptr, batch.prefix_lens, kv_end=window)
    o_ref, lse_ref = _direct(q, k, v, pages, [12], [3], kv_end=[12])
    torch.testing.assert_close(lse.double(), lse_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(o.double(), o_ref, atol=1e-5, rtol=1e-5)
    # a window reaching into the queries' own tokens keeps its causal mask
    assert plan_attention(batch.page_table, PAGE, batch.q_indptr, batch.prefix_lens).mask is not None


def test_merge_two_empty_sides_gives_zero_and_minus_inf():
    o = torch.randn(3, 2, 4)
    lse = torch.full((3, 2), -math.inf)
    merged, merged_lse = merge_states(o * 0, lse, o * 0, lse)
    assert (merged == 0).all() and torch.isneginf(merged_lse).all()


def test_torch_backend_uses_kv_cache_and_returns_lse():
    q, k, v, pages, batch = _random_case(PREFIXES, NEWS, seed=4)
    cache = KVCache(num_layers=2, num_pages=k.shape[0] // PAGE, page_size=PAGE, num_kv_heads=HKV,
                    head_dim=D, dtype=torch.float32, device="cpu")
    cache.k[1].copy_(k)
    cache.v[1].copy_(v)
    backend = TorchBackend()
    o, lse = backend.forward_with_lse(q, 1, cache, batch)
    o_ref, lse_ref = extend_reference(q, k, v, batch.page_table, PAGE, batch.q_indptr, batch.prefix_lens)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)
    torch.testing.assert_close(lse, lse_ref, rtol=0, atol=0)
    torch.testing.assert_close(backend.forward(q, 1, cache, batch), o_ref, rtol=0, atol=0)


def test_torch_backend_layer_windows_softcap_and_scale():
    """Per-layer attention (``set_layers``): a sliding window, soft-capped scores and a softmax scale of its
    own, against the direct computation; a plain layer beside them is unchanged."""
    prefixes, news = [0, 9, 13, 3], [7, 1, 4, 6]
    q, k, v, pages, batch = _random_case(prefixes, news, seed=5)
    cache = KVCache(num_layers=2, num_pages=k.shape[0] // PAGE, page_size=PAGE, num_kv_heads=HKV,
                    head_dim=D, dtype=torch.float32, device="cpu")
    for layer in (0, 1):
        cache.k[layer].copy_(k)
        cache.v[layer].copy_(v)
    backend = TorchBackend()
    assert backend.set_layers([LayerAttention(window=5, logit_softcap=0.5, sm_scale=0.2), LayerAttention()]) is None
    o_ref, lse_ref = _direct(q, k, v, pages, prefixes, news, window=5, softcap=0.5, scale=0.2)
    o, lse = backend.forward_with_lse(q, 0, cache, batch)
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), lse_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(backend.forward(q, 0, cache, batch).double(), o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(backend.forward(q, 1, cache, batch).double(), _direct(q, k, v, pages, prefixes, news)[0],
                               rtol=1e-5, atol=1e-5)


def test_triton_backend_refuses_what_its_kernels_cannot_compute():
    """The kernels compute plain causal attention: one window on every layer caps the context at it; windows
    beside full layers, soft-capping and per-layer scales are refused, by name."""
    pytest.importorskip("triton")
    from radixrelay.attention.triton_backend import TritonBackend

    backend = TritonBackend(overlap=False)
    assert backend.set_layers([LayerAttention()] * 2) is None
    assert backend.set_layers([LayerAttention(window=64)] * 2) == 64
    with pytest.raises(ValueError, match="sliding-window layers beside .* not yet supported on cuda"):
        backend.set_layers([LayerAttention(window=64), LayerAttention()])
    with pytest.raises(ValueError, match="soft-capping .* not yet supported on cuda"):
        backend.set_layers([LayerAttention(logit_softcap=50.0)])


def test_build_forward_batch_exact_layout():
    batch = build_forward_batch(
        [BatchRequest([7, 2], start=3, num_new=3), BatchRequest([5], start=2, num_new=1, num_logits=0),
         BatchRequest([1, 0, 4], start=8, num_new=1)], page_size=4, device="cpu")
    assert batch.q_indptr.tolist() == [0, 3, 4, 5]
    assert batch.prefix_lens.tolist() == [3, 2, 8]
    assert batch.seq_lens.tolist() == [6, 3, 9]
    assert batch.page_table.tolist() == [[7, 2, 0], [5, 0, 0], [1, 0, 4]]
    assert batch.positions.tolist() == [3, 4, 5, 2, 8]
    assert batch.out_slots.tolist() == [31, 8, 9, 22, 16]
    assert batch.logits_indices.tolist() == [2, 4]
    assert (batch.max_q_len, batch.max_seq_len, batch.num_tokens, batch.num_requests) == (3, 9, 5, 3)
    assert not batch.is_decode
    assert batch.page_table.dtype == torch.int32 and batch.out_slots.dtype == torch.int64


def test_build_forward_batch_logits_for_trailing_rows():
    """A prompt-logprobs extend asks logits for its last ``num_logits`` rows; decodes keep one."""
    batch = build_forward_batch([BatchRequest([7, 2], start=3, num_new=4, num_logits=3),
                                 BatchRequest([5], start=2, num_new=1)], page_size=4, device="cpu")
    assert batch.logits_indices.tolist() == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="num_logits"):
        build_forward_batch([BatchRequest([7], start=0, num_new=2, num_logits=3)], page_size=4, device="cpu")


@pytest.mark.parametrize("request_, message", [
    (BatchRequest([0], start=3, num_new=2), "cannot hold"),
    (BatchRequest([0], start=0, num_new=0), "num_new >= 1"),
])
def test_build_forward_batch_rejects_bad_requests(request_, message):
    with pytest.raises(ValueError, match=message):
        build_forward_batch([request_], page_size=4, device="cpu")


def test_kv_cache_store_writes_slots():
    cache = KVCache(num_layers=1, num_pages=3, page_size=2, num_kv_heads=1, head_dim=2,
                    dtype=torch.float32, device="cpu")
    k = torch.arange(4.0).view(2, 1, 2)
    cache.store(0, torch.tensor([5, 1]), k, -k)
    assert cache.k[0][5].tolist() == [[0.0, 1.0]] and cache.k[0][1].tolist() == [[2.0, 3.0]]
    assert cache.v[0][5].tolist() == [[-0.0, -1.0]]
    assert cache.num_slots == 6 and cache.nbytes() == 2 * 6 * 2 * 4
    with pytest.raises(ValueError, match="page_size"):
        KVCache(num_layers=1, num_pages=3, page_size=0, num_kv_heads=1, head_dim=2,
                dtype=torch.float32, device="cpu")


def test_forward_batch_is_frozen():
    batch = build_forward_batch([BatchRequest([0], start=0, num_new=3)], 4, "cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        batch.page_size = 8  # type: ignore[misc]
