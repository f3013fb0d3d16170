"""Cascade is a reformulation, not an approximation: Scheduler + ModelRunner on random trees of shared
prefixes give the same logits and greedy tokens with cascade on and off (decode and prefill cascade)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixrelay.attention.factory import make_backend
from radixrelay.cascade.batch import long_prefix_runs
from radixrelay.model import ModelConfig, load_model
from radixrelay.protocol.step import ModuleSpan
from radixrelay.worker import model_runner
from radixrelay.worker.graph_step import round_length
from tests.cascade.harness import Wave, run_workload

pytestmark = pytest.mark.slow

CFG = ModelConfig(architecture="llama", vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=1024)


def tiny_llama(dtype: torch.dtype):
    net, _ = load_model(CFG, dtype=dtype, seed=11)
    with torch.no_grad():          # dummy weights are small; scale up so attention is far from uniform
        for p in net.parameters():
            p.mul_(6.0 if p.dim() == 2 else 1.0)
    return net


@pytest.fixture(scope="module")
def llama64():
    return tiny_llama(torch.float64)


@pytest.fixture(scope="module")
def llama32():
    return tiny_llama(torch.float32)


def prompt_tree(rng: random.Random, system_len: int, problems: int, samples: int) -> list[Wave]:
    """A system prompt, problems under it, samples under each problem: cached wave by wave."""
    tok = lambda n: [rng.randrange(CFG.vocab_size) for _ in range(n)]  # noqa: E731
    system = tok(system_len)
    stems = [system + tok(rng.randint(1, 12)) for _ in range(problems)]
    waves: list[Wave] = [[(1000, system)]] if system_len else []
    waves.append([(2000 + i, s) for i, s in enumerate(stems)])
    waves.append([(i * 100 + j, s + tok(rng.randint(1, 5))) for i, s in enumerate(stems) for j in range(samples)])
    return waves


def assert_same(off, on, atol: float) -> None:
    assert on.tokens == off.tokens
    assert len(on.logits) == len(off.logits)
    for step_off, step_on in zip(off.logits, on.logits):
        assert step_on.keys() == step_off.keys()
        for rid in step_off:
            torch.testing.assert_close(step_on[rid], step_off[rid], rtol=0, atol=atol)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31), system_len=st.integers(0, 14), problems=st.integers(1, 3),
       samples=st.integers(1, 4), page_size=st.sampled_from([1, 2, 4]))
def test_random_trees_same_logits_fp64(llama64, seed, system_len, problems, samples, page_size):
    waves = prompt_tree(random.Random(seed), system_len, problems, samples)
    off = run_workload(llama64, waves, mode="off", max_tokens=3, page_size=page_size)
    on = run_workload(llama64, waves, mode="on", max_tokens=3, page_size=page_size)
    assert_same(off, on, atol=1e-10)


def test_fp32_greedy_identical_and_cascade_used(llama32):
    waves = prompt_tree(random.Random(5), system_len=13, problems=3, samples=4)
    off = run_workload(llama32, waves, mode="off", max_tokens=6)
    on = run_workload(llama32, waves, mode="on", max_tokens=6)
    assert_same(off, on, atol=1e-4)
    counters = on.planner.counters
    assert counters.cascade_steps >= 5 and counters.max_levels == 2 and counters.tokens_read_once > 0
    # auto: runs this short never pay, the plan stays flat
    auto = run_workload(llama32, waves, mode="auto", max_tokens=6)
    assert auto.planner.counters.cascade_steps == 0 and auto.tokens == off.tokens


def test_triton_backend_through_the_runner(llama32):
    """The Triton backend (interpreter) with cascade on vs the torch backend with cascade off."""
    waves = prompt_tree(random.Random(7), system_len=8, problems=2, samples=2)
    off = run_workload(llama32, waves, mode="off", max_tokens=2)
    on = run_workload(llama32, waves, mode="on", max_tokens=2, backend=make_backend("triton", "cpu"))
    assert on.planner.counters.cascade_steps > 0
    assert_same(off, on, atol=2e-3)


def test_decode_graph_buffers(llama32):
    """DecodeGraphs' padded buffers and fixed plans (eager on the CPU) give the unpadded result:
    batches of 1-6 decodes padded to buckets 1, 2, 4, 8, with and without cascade groups; repeated
    batches advanced on the device (page size 4: rows cross into appended pages while advancing).
    Extends stay off the graphs here (``small_extend_rows`` 0): the first graph would cover every bucket.

    The last wave's requests finish one after another, shrinking the batch into a smaller bucket: those
    steps run on the larger graph already captured (padded rows attend nothing), with the unpadded result,
    and capture nothing new: the rows given up are patched to padding in place while the bucket stays
    (6 -> 5 rows), and a step in a smaller bucket runs on the covering graph."""
    waves = prompt_tree(random.Random(11), system_len=8, problems=2, samples=3)
    system, stems, samples = waves       # the samples stop one after another: 6, 5, 4, 3 rows
    limits = {rid: 3 for rid, _ in system} | {rid: 2 for rid, _ in stems} | {
        rid: min(2 + i, 5) for i, (rid, _) in enumerate(samples)}
    off = run_workload(llama32, waves, mode="off", max_tokens=limits)
    for mode in ("off", "on"):
        got = run_workload(llama32, waves, mode=mode, max_tokens=limits, backend=make_backend("triton", "cpu"),
                           graph_max_batch=8, small_extend_rows=0)
        counters = got.graphs.counters
        assert got.graphs.captures >= 3 and counters.decode_steps_advanced >= 3
        assert counters.decode_steps_covered >= 1 and counters.decode_steps_patched >= 2
        # a decode step on rows of the last one (advanced on the device, the batch the same or shrunk) appends a page
        assert any(b.page_appends and a.decodes and set(b.decodes) <= set(a.decodes) and not (a.extends or b.extends)
                   for a, b in zip(got.plans, got.plans[1:]))
        if mode == "on":
            assert got.planner.counters.cascade_steps > 0
        assert_same(off, got, atol=2e-3)


def test_changing_batches_on_decode_graphs(llama32):
    """Requests join and leave a running batch (a pair arrives every 2 steps; each stops after its own
    number of tokens): decode steps whose rows changed refill the graph's rows and groups from the host
    (positions, slots, page-table rows in one upload), with and without cascade, and match eager."""
    rng = random.Random(13)
    system = [rng.randrange(CFG.vocab_size) for _ in range(8)]
    waves = [[(1000, system)]] + [[(10 * w + i, system + [rng.randrange(CFG.vocab_size) for _ in range(1 + w + i)])
                                   for i in range(2)] for w in range(1, 3)]
    limits = {rid: 3 + (7 * rid) % 2 for wave in waves for rid, _ in wave}
    off = run_workload(llama32, waves, mode="off", max_tokens=limits, arrive_every=2)
    for mode in ("off", "on"):
        got = run_workload(llama32, waves, mode=mode, max_tokens=limits, backend=make_backend("triton", "cpu"),
                           graph_max_batch=8, arrive_every=2)
        changed = [b for a, b in zip(got.plans, got.plans[1:]) if a.decodes and b.decodes and a.decodes != b.decodes
                   and not b.extends]
        assert len(changed) >= 2                   # decode-only steps after another set of rows
        assert got.runner.counters.graph_replays >= len(changed)
        if mode == "on":
            assert got.planner.counters.cascade_steps > 0
        assert_same(off, got, atol=2e-3)


@pytest.mark.parametrize("backend_name, model, atol", [("torch", "llama64", 1e-9), ("triton", "llama32", 2e-5)])
def test_long_cached_prefix_read_as_its_own_run_is_exact(request, monkeypatch, backend_name, model, atol):
    """A short extend after a long cached prefix reads the prefix as a shared run of its own (split along
    its length on the GPU): the same tokens and logits as reading it in the extend kernel."""
    rng = random.Random(5)
    doc = [rng.randrange(CFG.vocab_size) for _ in range(40)]
    waves: list[Wave] = [[(1, doc)], [(10 + i, doc + [rng.randrange(CFG.vocab_size) for _ in range(3)])
                                      for i in range(3)]]
    kw = dict(mode="off", max_tokens=2, backend=make_backend(backend_name, "cpu"))
    net = request.getfixturevalue(model)
    plain = run_workload(net, waves, **kw)
    made = []

    def recording(*args, **kwargs):
        made.extend(runs := long_prefix_runs(*args, **kwargs))
        return runs

    monkeypatch.setattr(model_runner, "long_prefix_runs", recording)
    split = run_workload(net, waves, long_prefix_tokens=16, **kw)
    assert_same(plain, split, atol=atol)
    assert [run.num_tokens for run in made] == [40, 40, 40]     # each question: the document, 10 pages of 4


def test_modular_rows_run_on_decode_graphs(llama32):
    """Modular prompts (module spans at their own positions, RoPE position = KV index + delta) decode on
    DecodeGraphs with the eager result, mixed with a plain request in the same batches, with cascade
    over the shared spans on and off; the deltas reach the graph (without them the logits differ)."""
    rng = random.Random(13)
    tok = lambda n: [rng.randrange(CFG.vocab_size) for _ in range(n)]  # noqa: E731
    a = ModuleSpan("\x1fm\x1fA", tok(8), [(0, 0)], 8)            # positions 0..7
    b = ModuleSpan("\x1fm\x1fB", tok(4), [(0, 20)], 4)           # a union: B and C both at 20..23
    c = ModuleSpan("\x1fm\x1fC", tok(4), [(0, 20)], 3)
    modular, wave = {}, []
    for rid, spans in ((1, [a, b]), (2, [b, a]), (3, [a, c]), (4, [c])):
        head = [t for s in spans for t in s.token_ids]
        modular[rid] = (spans, [(len(head), 40 - len(head))])    # new text at positions 40, 41, ...
        wave.append((rid, head + tok(3)))
    wave.append((5, tok(9)))                                     # a plain prompt in the same batches
    eager = run_workload(llama32, [wave], mode="off", max_tokens=6, modular=modular)
    for mode in ("off", "on"):
        got = run_workload(llama32, [wave], mode=mode, max_tokens=6, backend=make_backend("triton", "cpu"),
                           graph_max_batch=8, modular=modular)
        assert got.graphs.captures >= 1 and got.graphs.counters.decode_steps_advanced >= 2
        assert_same(eager, got, atol=2e-3)
    assert got.planner.counters.cascade_steps > 0
    flat = {rid: (spans, [(0, 0)]) for rid, (spans, _) in modular.items()}   # no delta on the new text
    unshifted = run_workload(llama32, [wave], mode="off", max_tokens=6, modular=flat)
    assert any(not torch.allclose(unshifted.logits[-1][rid], eager.logits[-1][rid], atol=1e-3) for rid in (1, 2, 3, 4))


def test_small_extends_run_as_decode_graph_rows(llama32):
    """Steps whose extends compute a few tokens run on the decode graphs, one row per extend token (a
    token sees the ones before it: every layer stores all rows' K/V before attention), also beside
    decodes; an extend after a long cached prefix reads it as a shared run whose host length is
    rounded up (page size 2 here: a cached length like 34 plans as 36); decodes beside them keep their
    cascade plan (its runs shifted past the extend rows), and steps without one run the extend rows
    beside flat decodes. Logits as the eager torch path."""
    waves = prompt_tree(random.Random(22), system_len=24, problems=2, samples=2)
    options = dict(max_tokens=2, chunked_prefill_tokens=8, page_size=2)   # extends beside decodes
    off = run_workload(llama32, waves, mode="off", **options)
    got = run_workload(llama32, waves, mode="on", backend=make_backend("triton", "cpu"), graph_max_batch=16,
                       long_prefix_tokens=8, **options)
    assert_same(off, got, atol=2e-3)
    # every one of them
    assert got.runner.counters.extend_row_steps == sum(1 for p in got.plans if p.extends) >= 4
    assert any(p.extends and p.decodes and p.cascade is not None for p in got.plans)
    assert any(p.extends and p.decodes and p.cascade is None for p in got.plans)
    assert any(p.extends and any(e.start >= 8 for e in p.extends) for p in got.plans)
    # a cached prefix (whole pages) read as a run, its rows reading 8 tokens or more of it, planned rounded up
    cached = [e.start // 2 * 2 for p in got.plans for e in p.extends if e.start // 2 * 2 * e.num_tokens >= 8]
    assert any(round_length(n) > n for n in cached)
