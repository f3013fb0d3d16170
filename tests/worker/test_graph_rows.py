"""Stable decode-graph rows: a request keeps its graph row from step to step, so a decode step whose batch
changed (requests joined, left) patches only the changed rows on the device (``DeviceBatch.arrange`` /
``DecodeGraphs.advance``) instead of refilling every row from the host.

- ``arrange`` (host logic): the order is a permutation of the step's rids, requests that stay keep their
  rows unless moved into a freed row, rows stay dense, and the changed rows are exactly those holding
  another request than before.
- End to end through ``ModelRunner``: a churning decode batch (joins straight into decode, leaves with and
  without a newcomer, page appends, a cascade group over a shared prefix or flat) on the decode graphs
  (Triton kernels; eager replay on the CPU, captured CUDA graphs with ``-m gpu``) gives the logits and
  tokens of the eager runner, with most changed steps patched.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixrelay.attention import KVCache, TorchBackend
from radixrelay.attention.factory import make_backend
from radixrelay.model import ModelConfig, load_model
from radixrelay.protocol.cascade import CascadeGroup, CascadePlan
from radixrelay.protocol.step import AdmittedRequest, PageAppend, StepPlan
from radixrelay.sampling_params import SamplingParams
from radixrelay.worker.cuda_graphs import DecodeGraphs
from radixrelay.worker.device_batch import MAX_PATCH_ROWS, DeviceBatch, GraphRows
from radixrelay.worker.model_runner import ModelRunner
from tests.cascade.harness import RecordingSampler

pytestmark = pytest.mark.slow

PS = 4
CFG = ModelConfig(architecture="llama", vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512)
SHARED = 6                                # shared pages: 24 cached tokens every request begins with
NUM_PAGES = 160


@pytest.fixture(scope="module")
def model():
    net, _ = load_model(CFG, dtype=torch.float32, seed=4)
    with torch.no_grad():
        for p in net.parameters():
            p.mul_(6.0 if p.dim() == 2 else 1.0)
    return net


def kv_cache(device: str = "cpu") -> KVCache:
    kv = KVCache(num_layers=CFG.num_layers, num_pages=NUM_PAGES + 1, page_size=PS,
                 num_kv_heads=CFG.num_kv_heads, head_dim=CFG.head_dim, dtype=torch.float32, device=device)
    kv.buffer.copy_(torch.randn(kv.buffer.shape, generator=torch.Generator().manual_seed(0)))   # "cached" KV
    return kv


def graphs_of(model, kv: KVCache, max_batch: int = 16) -> DecodeGraphs:
    return DecodeGraphs(model, kv, make_backend("triton", kv.device.type), max_batch=max_batch,
                        max_pages=NUM_PAGES, scratch_slot=NUM_PAGES * PS)


# -- arrange ------------------------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(before=st.lists(st.integers(0, 60), min_size=1, max_size=24, unique=True), data=st.data())
def test_arrange_keeps_rows_of_staying_requests(before, data):
    stay = data.draw(st.lists(st.sampled_from(before), unique=True))
    joined = data.draw(st.lists(st.integers(100, 160), max_size=12, unique=True))
    rids = data.draw(st.permutations(stay + joined))
    if not rids:
        return
    batch = DeviceBatch()
    batch.last = GraphRows(None, list(before), None, 1)
    order = batch.arrange(rids)
    left = len(before) - len(stay)
    if left + len(joined) > MAX_PATCH_ROWS:
        assert order is rids
        return
    assert sorted(order) == sorted(rids)                        # a permutation: every row holds a request
    changed = batch.changed_rows(order)
    assert changed == [i for i, rid in enumerate(order) if i >= len(before) or before[i] != rid]
    # each change is a newcomer, or a staying request moved into a row freed by one that left
    assert len(changed) <= left + len(joined)
    assert sum(1 for i in changed if order[i] in stay) <= left
    if not left and not joined:
        assert order == before


def test_arrange_without_a_last_step_or_with_too_many_changes_keeps_the_plan_order():
    batch = DeviceBatch()
    rids = [5, 3, 9]
    assert batch.arrange(rids) is rids and batch.changed_rows(rids) is None
    batch.last = GraphRows(None, list(range(MAX_PATCH_ROWS + 1)), None, 1)
    fresh = list(range(1000, 1000 + MAX_PATCH_ROWS + 1))
    assert batch.arrange(fresh) is fresh


# -- through the runner -------------------------------------------------------------------------------


class Churn:
    """The scheduler's side of a decode batch over a shared prefix: requests join straight into decode
    (cached up to their last token), leave, and get a page when their next position needs one."""

    def __init__(self, cascade: bool, seed: int) -> None:
        self.rng = random.Random(seed)
        self.cascade = cascade
        self.shared = list(range(SHARED))
        self.free = list(range(SHARED, NUM_PAGES))
        self.pages: dict[int, list[int]] = {}
        self.num_tokens: dict[int, int] = {}
        self.rids: list[int] = []
        self.next_rid = 1
        self.step_id = 0

    def _admit(self) -> AdmittedRequest:
        rid, self.next_rid = self.next_rid, self.next_rid + 1
        own = self.rng.randint(1, 9)
        n = SHARED * PS + own
        self.pages[rid] = self.shared + [self.free.pop(0) for _ in range(-(-own // PS))]
        self.num_tokens[rid] = n
        self.rids.append(rid)
        return AdmittedRequest(rid, [self.rng.randrange(CFG.vocab_size)], n, list(self.pages[rid]),
                               SamplingParams(max_tokens=1000, temperature=0), token_offset=n - 1)

    def plan(self, leave: int, join: int) -> StepPlan:
        released = []
        for _ in range(leave):
            rid = self.rids.pop(self.rng.randrange(len(self.rids)))
            self.free.extend(self.pages.pop(rid)[SHARED:])
            del self.num_tokens[rid]
            released.append(rid)
        admitted = [self._admit() for _ in range(join)]
        appends = []
        for rid in self.rids:
            if (self.num_tokens[rid] - 1) // PS >= len(self.pages[rid]):
                page = self.free.pop(0)
                self.pages[rid].append(page)
                appends.append(PageAppend(rid, [page]))
        cascade = None
        if self.cascade:
            tokens = SHARED * PS
            cascade = CascadePlan([CascadeGroup(list(self.rids), 0, tokens, 0)], dict.fromkeys(self.rids, tokens))
        plan = StepPlan(self.step_id, released=released, admitted=admitted, page_appends=appends,
                        decodes=list(self.rids), cascade=cascade)
        self.step_id += 1
        for rid in self.rids:
            self.num_tokens[rid] += 1
        return plan


def step_both(eager: ModelRunner, fast: ModelRunner, plan: StepPlan) -> None:
    """Run ``plan`` on the eager runner and the graph runner: no errors, every decode row's logits within
    2e-3 of the eager ones, the same tokens."""
    want, got = eager.step(plan), fast.step(plan)
    assert want.error is None and got.error is None, (want.error, got.error)
    assert sorted(got.rids) == sorted(plan.decodes)
    want_rows, got_rows = dict(zip(want.rids, eager.sampler.last)), dict(zip(got.rids, fast.sampler.last))
    for rid in plan.decodes:
        torch.testing.assert_close(got_rows[rid], want_rows[rid], rtol=0, atol=2e-3)
    assert dict(zip(got.rids, got.token_ids)) == dict(zip(want.rids, want.token_ids))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("cascade", [True, False])
def test_churning_decode_batch_is_patched_and_exact(model, cascade, device):
    net = copy.deepcopy(model).to(device)
    eager_kv, graph_kv = kv_cache(device), kv_cache(device)
    # eager: the torch reference on the CPU; on CUDA the same Triton kernels launched without graphs
    eager = ModelRunner(net, eager_kv, TorchBackend() if device == "cpu" else make_backend("triton", device))
    # buckets 1, 2, 4, 6: a batch of 4 to 6 rows stays on the 6-row graph (more than half of it)
    graphs = graphs_of(net, graph_kv, max_batch=6)
    fast = ModelRunner(net, graph_kv, make_backend("triton", device), graphs=graphs)
    eager.sampler, fast.sampler = RecordingSampler(eager.sampler), RecordingSampler(fast.sampler)
    work = Churn(cascade, seed=7)
    # (leave, join) per step: start, steady, a join and a leave, leaves only (rows moved or given up),
    # joins only (rows past the end), several of each.
    script = [(0, 6), (0, 0), (1, 1), (2, 0), (1, 0), (0, 2), (3, 3), (0, 0)]
    for leave, join in script:
        step_both(eager, fast, work.plan(leave, join))
    changed = sum(1 for leave, join in script[1:] if leave or join)

    steps = graphs.counters
    assert steps.decode_steps_patched >= changed - 1          # one may need another bucket or launch shape: full path
    assert steps.decode_steps_advanced >= steps.decode_steps_patched + 2   # and the steady steps advanced as before


def test_uncovered_size_class_runs_piecewise_until_it_recurs(model, monkeypatch):
    """With piecewise graphs beside them, the decode graphs do not capture a size class on its first
    step (a ~100 ms stall at the start of a burst): a class no captured graph covers runs on the
    piecewise graphs until it has been seen ``CAPTURE_UNCOVERED_AFTER`` times, then gets its graph; outputs as
    the eager runner's throughout."""
    from radixrelay.worker import cuda_graphs
    from radixrelay.worker.piecewise_graphs import PiecewiseGraphs

    monkeypatch.setattr(cuda_graphs, "CAPTURE_UNCOVERED_AFTER", 3)
    eager_kv, graph_kv = kv_cache(), kv_cache()
    eager = ModelRunner(model, eager_kv, TorchBackend())
    backend = make_backend("triton", "cpu")
    graphs = graphs_of(model, graph_kv)
    piecewise = PiecewiseGraphs(model, graph_kv, backend, token_buckets=[8, 16], scratch_slot=NUM_PAGES * PS)
    fast = ModelRunner(model, graph_kv, backend, graphs=graphs, piecewise=piecewise)
    eager.sampler, fast.sampler = RecordingSampler(eager.sampler), RecordingSampler(fast.sampler)
    work = Churn(cascade=True, seed=3)
    for i, (leave, join) in enumerate([(0, 6), (0, 0), (0, 0), (0, 0)]):
        step_both(eager, fast, work.plan(leave, join))
        if i < 2:           # seen once, twice: piecewise, no capture
            assert (graphs.captures == 0 and graphs.counters.decode_steps_deferred == i + 1
                    and piecewise.replays == i + 1)
    assert graphs.captures == 1 and graphs.counters.decode_steps_deferred == 2 and piecewise.replays == 2
    assert graphs.counters.decode_steps_advanced == 1     # the captured class then continues on the device


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_start_up_covers_run_new_size_classes_without_deferral(model, device):
    """``capture_covers`` at start-up: a flat and a cascade graph per cover bucket. A fresh batch's
    steps (classes never seen: cascade steps, then the same rows flat) then replay a cover instead of
    running piecewise or capturing, with the eager runner's outputs; a cover is the smallest graph holding
    the step's rows."""
    from radixrelay.worker.piecewise_graphs import PiecewiseGraphs

    net = copy.deepcopy(model).to(device)
    eager_kv, graph_kv = kv_cache(device), kv_cache(device)
    eager = ModelRunner(net, eager_kv, TorchBackend() if device == "cpu" else make_backend("triton", device))
    backend = make_backend("triton", device)
    graphs = graphs_of(net, graph_kv, max_batch=8)
    assert graphs.capture_covers(buckets=(4,)) == 4              # buckets 4 and 8 (max_batch), flat and cascade
    assert graphs.capture_covers(buckets=(4,)) == 0              # captured once
    piecewise = PiecewiseGraphs(net, graph_kv, backend, token_buckets=[8, 16], scratch_slot=NUM_PAGES * PS)
    fast = ModelRunner(net, graph_kv, backend, graphs=graphs, piecewise=piecewise)
    eager.sampler, fast.sampler = RecordingSampler(eager.sampler), RecordingSampler(fast.sampler)
    work = Churn(cascade=True, seed=5)
    for leave, join in [(0, 3), (0, 0), (1, 2)]:
        step_both(eager, fast, work.plan(leave, join))
    # a light node's launch shape is not the cover's: its steps ran covered (flat rows may have the
    # cover's own shape: one split, then it is theirs)
    assert graphs.counters.decode_steps_covered >= 1
    work.cascade = False
    for leave, join in [(0, 0), (2, 1), (0, 0)]:
        step_both(eager, fast, work.plan(leave, join))
    assert graphs.counters.decode_steps_deferred == 0 and piecewise.replays == 0 and graphs.captures == 4
    assert {g.key[0] for g in graphs._graphs.values()} == {4, 8}
    last = fast.device_batch.last
    assert last is not None and last.graph.key[0] == 4 and not last.graph.cascade   # <= 4 rows: the 4-row flat cover


def test_batch_shrinking_below_its_bucket_stays_on_its_graph(model):
    """A batch that shrinks into a smaller bucket keeps advancing on its graph (rows given up become
    padding) while it fills more than half of it, and grows back there without a refill: no full step
    for a batch flapping across a bucket boundary. Below half the graph the step takes the full path (here
    on the same graph again, as the covering graph of a class not seen before)."""
    eager_kv, graph_kv = kv_cache(), kv_cache()
    eager = ModelRunner(model, eager_kv, TorchBackend())
    graphs = graphs_of(model, graph_kv, max_batch=6)          # buckets 1, 2, 4, 6
    fast = ModelRunner(model, graph_kv, make_backend("triton", "cpu"), graphs=graphs)
    eager.sampler, fast.sampler = RecordingSampler(eager.sampler), RecordingSampler(fast.sampler)
    work = Churn(cascade=True, seed=9)
    # (leave, join, rows after, graph rows expected, advanced on the device)
    script = [(0, 6, 6, 6, False), (0, 0, 6, 6, True), (2, 0, 4, 6, True), (0, 1, 5, 6, True),
              (1, 0, 4, 6, True), (0, 0, 4, 6, True), (2, 0, 2, 6, False)]
    for leave, join, rows, graph_rows, advanced in script:
        plan = work.plan(leave, join)
        before = graphs.counters.decode_steps_advanced
        step_both(eager, fast, plan)
        assert len(plan.decodes) == rows
        assert len(fast.device_batch.last.graph.ids) == graph_rows
        assert (graphs.counters.decode_steps_advanced > before) == advanced, (leave, join)
    assert graphs.captures == 1 and graphs.counters.decode_steps_covered == 1


def test_a_cover_reading_a_long_row_in_one_piece_does_not_cover_it():
    """A start-up cover reads a row's own KV in one piece per KV head (its one split's chunk spans the
    whole context): fine for short rows, but a row longer than ``COVER_OWN_TOKENS`` runs on a graph only
    if it cuts the row into at least half the pieces of the step's own size class launch."""
    from types import SimpleNamespace

    from radixrelay.worker.cuda_graphs import COVER_OWN_TOKENS, _covers, _Need

    longest = 131072
    one_piece = SimpleNamespace(own_splits=1, own_chunk=longest, m_tiles=1, shared_config=(16, 0, 0, 0), kv_tma=False)
    split = SimpleNamespace(own_splits=16, own_chunk=longest // 16, m_tiles=1, shared_config=(16, 0, 0, 0),
                            kv_tma=False)
    long_row, short_row = 112_000, COVER_OWN_TOKENS
    assert _covers(one_piece, _Need(False, 4, short_row, False, 32))          # short: covered as before
    assert not _covers(one_piece, _Need(False, 4, long_row, False, 32))       # long, class splits 32: not
    assert _covers(one_piece, _Need(False, 4, long_row, False, 1))            # the class itself reads it whole
    assert _covers(one_piece, _Need(False, 4, long_row, False))               # unchecked (advance's refill)
    assert _covers(split, _Need(False, 4, long_row, False, 28))               # 14 pieces of 28: enough
    assert not _covers(split, _Need(False, 4, long_row, False, 64))           # 14 of 64: not
