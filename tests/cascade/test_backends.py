"""Cascade at the attention level: random trees of shared prefixes give the flat result (exact up to
rounding), in the torch reference backend (float64) and the Triton backend (fp32, interpreter on CPU)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixrelay.attention.backend import TorchBackend, merge_rows
from radixrelay.attention.factory import make_backend
from radixrelay.attention.reference import merge_states
from tests.cascade.trees import random_scenario


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), page_size=st.sampled_from([1, 2, 4]), num_extends=st.integers(0, 4),
       num_decodes=st.integers(0, 8))
def test_torch_cascade_equals_flat(seed, page_size, num_extends, num_decodes):
    if num_extends + num_decodes == 0:
        return
    rng = random.Random(seed)
    sc = random_scenario(rng, page_size=page_size, num_extends=num_extends, num_decodes=num_decodes)
    q = torch.randn(sc.flat.num_tokens, 4, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    o_flat, lse_flat = TorchBackend().forward_with_lse(q, 0, sc.cache, sc.flat)
    o_cas, lse_cas = TorchBackend().forward_with_lse(q, 0, sc.cache, sc.cascaded)
    torch.testing.assert_close(o_cas, o_flat, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse_cas, lse_flat, rtol=0, atol=1e-12)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), page_size=st.sampled_from([1, 2, 4]), num_decodes=st.integers(2, 8))
def test_groups_split_at_page_breaks_equal_flat(seed, page_size, num_decodes):
    """Nodes on runs of consecutive pages, decode groups split at every page-id break (one group per
    piece, the same rows): still exactly flat attention."""
    rng = random.Random(seed)
    sc = random_scenario(rng, page_size=page_size, num_extends=1, num_decodes=num_decodes, runs_of_pages=True,
                         split_pages=True)
    q = torch.randn(sc.flat.num_tokens, 4, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    o_flat, lse_flat = TorchBackend().forward_with_lse(q, 0, sc.cache, sc.flat)
    o_cas, lse_cas = TorchBackend().forward_with_lse(q, 0, sc.cache, sc.cascaded)
    torch.testing.assert_close(o_cas, o_flat, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse_cas, lse_flat, rtol=0, atol=1e-12)


def test_scenarios_do_cascade():
    """The random trees above are not vacuous: most have groups, in both phases."""
    rng = random.Random(0)
    scenarios = [random_scenario(rng, page_size=2, num_extends=3, num_decodes=6) for _ in range(30)]
    assert sum(s.cascaded.cascade.decode is not None for s in scenarios) > 15
    assert sum(s.cascaded.cascade.prefill is not None for s in scenarios) > 5


def test_split_scenarios_do_split():
    """The page-run scenarios above are not vacuous: groups do split, and the pieces are contiguous."""
    split = 0
    for i in range(20):
        kw = dict(page_size=2, num_extends=1, num_decodes=6, runs_of_pages=True)
        a = random_scenario(random.Random(i), split_pages=True, **kw)
        b = random_scenario(random.Random(i), split_pages=False, **kw)
        if a.cascaded.cascade.decode is not None:
            assert a.cascaded.cascade.decode.contiguous
            split += a.num_groups > b.num_groups
    assert split >= 8


def test_merge_rows_matches_pairwise_merges():
    gen = torch.Generator().manual_seed(0)
    o = torch.randn(5, 3, 4, generator=gen, dtype=torch.float64)
    lse = torch.randn(5, 3, generator=gen, dtype=torch.float64)
    lse[4] = float("-inf")                      # an empty part never contributes
    rows = torch.tensor([0, 1, 0, 2, 1])
    got_o, got_lse = merge_rows([(o, lse, rows)], 4)
    want_o, want_lse = merge_states(o[0:1], lse[0:1], o[2:3], lse[2:3])
    torch.testing.assert_close(got_o[0:1], want_o)
    torch.testing.assert_close(got_lse[0:1], want_lse)
    torch.testing.assert_close(got_o[1], o[1])
    assert got_lse[3].isinf().all() and (got_o[3] == 0).all()   # row 3: no parts


@pytest.mark.parametrize("seed,runs", [(0, False), (1, False), (2, False), (3, True), (4, True)])
def test_triton_backend_matches_reference(seed, runs):
    """fp32 Triton (flat and cascaded, both phases) against the float64 reference of the flat batch;
    ``runs``: nodes on runs of consecutive pages, decode groups split at the page-id breaks."""
    rng = random.Random(100 + seed)
    sc = random_scenario(rng, page_size=2, num_extends=2, num_decodes=5, dtype=torch.float32, runs_of_pages=runs,
                         split_pages=runs)
    assert sc.num_groups > 0
    q = torch.randn(sc.flat.num_tokens, 4, 16, generator=torch.Generator().manual_seed(seed))
    want_o, want_lse = TorchBackend().forward_with_lse(q.double(), 0, _as(sc.cache, torch.float64), sc.flat)
    backend = make_backend("triton", "cpu")
    for batch in (sc.flat, sc.cascaded):
        o, lse = backend.forward_with_lse(q, 0, sc.cache, batch)
        torch.testing.assert_close(o.double(), want_o, rtol=0, atol=2e-5)
        torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=2e-5)


def _as(cache, dtype):
    import copy

    out = copy.copy(cache)
    out.k, out.v = [t.to(dtype) for t in cache.k], [t.to(dtype) for t in cache.v]
    return out
