"""How a step runs (``choose_path``): one pure function of facts of the plan and the persistent batch.

- Every path and every fallback from hand-written facts: the candidates in order, the last one a path
  that never declines (PIECEWISE or EAGER), ``defer`` set exactly when it is PIECEWISE.
- Invariants over random facts (hypothesis).
- The module imports no torch.
- Through ``ModelRunner`` on the CPU (decode graphs run eagerly, piecewise graphs without capture): a
  script of steps that takes each path once, the path that ran read from the counters.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixrelay.worker.step_path import Path, StepFacts, StepPath, choose_path

ADVANCE, PATCH_ROWS, DECODE_GRAPH = Path.ADVANCE, Path.PATCH_ROWS, Path.DECODE_GRAPH
EXTEND_ROWS, PIECEWISE, EAGER = Path.EXTEND_ROWS, Path.PIECEWISE, Path.EAGER


def facts(**changes) -> StepFacts:
    """A decode-only step of 8 rows continuing the last graph step unchanged, on a worker with decode graphs
    of 64 rows, 32 small-extend rows and piecewise graphs of 128 tokens; ``changes`` override."""
    base = dict(decodes=8, extends=0, extend_tokens=0, extend_logits=0, tier_loads=False, changed=0,
                modular=False, pages_hold=True, graph_rows=64, small_extend_rows=32, piecewise_tokens=128)
    return StepFacts(**{**base, **changes})


def extend_step(**changes) -> StepFacts:
    """Two extends of 12 tokens in all, one logits row each, beside 8 decodes; ``changes`` override."""
    return facts(**{**dict(extends=2, extend_tokens=12, extend_logits=1, changed=None, pages_hold=False), **changes})


CASES = [
    # -- decode-only on the decode graphs --------------------------------------------------------------
    ("advance: the last step's rows, none changed", facts(), (ADVANCE, DECODE_GRAPH, PIECEWISE)),
    ("advance with modular rows: no row patched, deltas kept", facts(modular=True), (ADVANCE, DECODE_GRAPH, PIECEWISE)),
    ("patch rows: joins and leaves", facts(changed=3), (PATCH_ROWS, DECODE_GRAPH, PIECEWISE)),
    ("patched rows with modular rows resident: filled", facts(changed=3, modular=True), (DECODE_GRAPH, PIECEWISE)),
    ("a page list short of the new position: filled (raises there)", facts(pages_hold=False),
     (DECODE_GRAPH, PIECEWISE)),
    ("no last graph step (or too many changes)", facts(changed=None), (DECODE_GRAPH, PIECEWISE)),
    ("decode graph, piecewise graphs not captured", facts(changed=None, piecewise_tokens=0), (DECODE_GRAPH, EAGER)),
    ("decode graph, past the piecewise graphs", facts(changed=None, decodes=200), (DECODE_GRAPH, EAGER)),
    ("advance, past the piecewise graphs", facts(decodes=129), (ADVANCE, DECODE_GRAPH, EAGER)),
    ("advance at the piecewise graphs' size", facts(decodes=128), (ADVANCE, DECODE_GRAPH, PIECEWISE)),
    # -- extends as decode-graph rows -------------------------------------------------------------------
    ("small extends beside decodes", extend_step(), (EXTEND_ROWS, PIECEWISE)),
    ("small extends alone", extend_step(decodes=0), (EXTEND_ROWS, PIECEWISE)),
    ("extend rows at the limit", extend_step(extend_tokens=32), (EXTEND_ROWS, PIECEWISE)),
    ("extend rows filling the graph", extend_step(extend_tokens=32, decodes=32), (EXTEND_ROWS, PIECEWISE)),
    ("extend rows, piecewise graphs not captured", extend_step(piecewise_tokens=0), (EXTEND_ROWS, EAGER)),
    ("extends past the small-extend rows", extend_step(extend_tokens=33), (PIECEWISE,)),
    ("extends and decodes past the graph's rows", extend_step(extend_tokens=32, decodes=33), (PIECEWISE,)),
    ("prompt logprobs (several logits rows)", extend_step(extend_logits=2), (PIECEWISE,)),
    ("KV tier loads in flight", extend_step(tier_loads=True), (PIECEWISE,)),
    ("small extends off (0 rows)", extend_step(small_extend_rows=0), (PIECEWISE,)),
    # -- packed on the host ----------------------------------------------------------------------------
    ("a prefill past the piecewise graphs", extend_step(extend_tokens=500, decodes=0), (EAGER,)),
    ("no decode graphs: piecewise", facts(graph_rows=0), (PIECEWISE,)),
    ("no decode graphs, no piecewise graphs: eager", facts(graph_rows=0, piecewise_tokens=0), (EAGER,)),
    ("no decode graphs, small extends: piecewise", extend_step(graph_rows=0), (PIECEWISE,)),
]


@pytest.mark.parametrize("case, f, want", CASES, ids=[c[0] for c in CASES])
def test_every_path_and_fallback(case, f, want):
    got = choose_path(f)
    assert got == StepPath(want, want[-1] is PIECEWISE), case
    assert got.candidates is choose_path(f).candidates          # answers are built once: no per-step tuple


def test_every_path_is_reached():
    assert {p for _, f, _ in CASES for p in choose_path(f).candidates} == set(Path)


@settings(max_examples=500, deadline=None)
@given(st.builds(StepFacts, decodes=st.integers(0, 300), extends=st.integers(0, 4), extend_tokens=st.integers(0, 600),
                 extend_logits=st.integers(0, 3), tier_loads=st.booleans(),
                 changed=st.none() | st.integers(0, 64), modular=st.booleans(), pages_hold=st.booleans(),
                 graph_rows=st.sampled_from([0, 16, 64, 320]), small_extend_rows=st.sampled_from([0, 32, 256]),
                 piecewise_tokens=st.sampled_from([0, 128, 512])))
def test_invariants(f):
    path = choose_path(f)
    first, last = path.candidates[:-1], path.candidates[-1]
    assert last in (PIECEWISE, EAGER) and PIECEWISE not in first and EAGER not in first
    assert path.defer == (last is PIECEWISE) == (f.extend_tokens + f.decodes <= f.piecewise_tokens)
    if not f.graph_rows:
        assert first == ()
    if f.extends:                                  # extends: on the graph's rows or packed, never advanced
        assert first in ((), (EXTEND_ROWS,))
        if first:
            assert f.extend_tokens <= f.small_extend_rows and f.extend_tokens + f.decodes <= f.graph_rows
            assert f.extend_logits <= 1 and not f.tier_loads
    elif f.graph_rows:                             # decode-only: the decode graph is always tried
        assert first[-1] is DECODE_GRAPH
        if len(first) == 2:
            assert f.changed is not None and f.pages_hold
            assert first[0] is (PATCH_ROWS if f.changed else ADVANCE)
            assert not (f.changed and f.modular)


def test_imports_no_torch():
    code = "import sys, radixrelay.worker.step_path; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# -- through the runner ------------------------------------------------------------------------------


def test_runner_takes_each_path(monkeypatch):
    """One runner with decode graphs (16 rows, 8 small-extend rows) and piecewise graphs (16 tokens): a
    small extend runs as graph rows, a decode fills a graph, the next advances, a larger extend runs
    piecewise, a join that needs a larger graph is filled (the patch declined), a join into a freed row is
    patched, a prefill past the piecewise graphs runs eagerly. Each step the path that ran (read from the
    counters) is the first of ``choose_path``'s candidates that can take it; tokens as the eager runner's."""
    from radixrelay.attention import TorchBackend
    from radixrelay.attention.factory import make_backend
    from radixrelay.model import load_model
    from radixrelay.protocol.step import AdmittedRequest, ExtendItem, StepPlan
    from radixrelay.sampling_params import SamplingParams
    from radixrelay.worker import cuda_graphs, model_runner
    from radixrelay.worker.model_runner import ModelRunner
    from radixrelay.worker.piecewise_graphs import PiecewiseGraphs
    from tests.worker.test_graph_rows import CFG, NUM_PAGES, PS, graphs_of, kv_cache

    monkeypatch.setattr(cuda_graphs, "CAPTURE_UNCOVERED_AFTER", 1)      # no deferral: each class captured at once
    chosen: list[StepPath] = []

    def recording(f: StepFacts) -> StepPath:
        chosen.append(choose_path(f))
        return chosen[-1]

    monkeypatch.setattr(model_runner, "choose_path", recording)
    model, _ = load_model(CFG, dtype=torch.float32, seed=4)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(6.0 if p.dim() == 2 else 1.0)     # peaked logits: greedy tokens far from ties
    eager = ModelRunner(model, kv_cache(), TorchBackend())
    graph_kv = kv_cache()
    backend = make_backend("triton", "cpu")
    graphs = graphs_of(model, graph_kv)
    piecewise = PiecewiseGraphs(model, graph_kv, backend, token_buckets=[8, 16], scratch_slot=NUM_PAGES * PS)
    fast = ModelRunner(model, graph_kv, backend, graphs=graphs, piecewise=piecewise)
    fast.small_extend_rows = 8
    assert fast.counters is graphs.counters
    greedy = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    next_page = iter(range(NUM_PAGES))

    def admit(rid: int, tokens: int) -> AdmittedRequest:
        pages = [next(next_page) for _ in range(-(-(tokens + 8) // PS))]
        return AdmittedRequest(rid, [(rid * 7 + i) % CFG.vocab_size for i in range(tokens)], tokens, pages, greedy)

    def counters() -> tuple[int, ...]:
        c = fast.counters                            # the decode graphs' too
        return (c.decode_steps_advanced, c.decode_steps_patched, c.extend_row_steps, piecewise.replays, c.eager_steps,
                c.graph_replays)

    # counter deltas of one step (advances, patches, extend rows, piecewise, eager, replays) -> the path that ran
    deltas = {(1, 0, 0, 0, 0, 1): ADVANCE, (1, 1, 0, 0, 0, 1): PATCH_ROWS, (0, 0, 0, 0, 0, 1): DECODE_GRAPH,
              (0, 0, 1, 0, 0, 1): EXTEND_ROWS, (0, 0, 0, 1, 0, 1): PIECEWISE, (0, 0, 0, 0, 1, 0): EAGER}

    # (plan, candidates chosen, the path that ran); own lengths stay within a power of two while advancing
    script = [
        (StepPlan(0, admitted=[admit(1, 5)], extends=[ExtendItem(1, 0, 5, True)]), (EXTEND_ROWS, PIECEWISE),
         EXTEND_ROWS),
        (StepPlan(1, decodes=[1]), (DECODE_GRAPH, PIECEWISE), DECODE_GRAPH),    # extend rows: nothing to advance
        (StepPlan(2, decodes=[1]), (ADVANCE, DECODE_GRAPH, PIECEWISE), ADVANCE),
        (StepPlan(3, admitted=[admit(2, 12)], extends=[ExtendItem(2, 0, 12, True)], decodes=[1]), (PIECEWISE,),
         PIECEWISE),
        (StepPlan(4, decodes=[1, 2]), (DECODE_GRAPH, PIECEWISE), DECODE_GRAPH),
        (StepPlan(5, decodes=[1, 2]), (ADVANCE, DECODE_GRAPH, PIECEWISE), ADVANCE),
        (StepPlan(6, admitted=[admit(3, 1)], decodes=[1, 2, 3]), (PATCH_ROWS, DECODE_GRAPH, PIECEWISE),
         DECODE_GRAPH),                                    # 3 rows past the 2-row graph: the patch declined
        (StepPlan(7, released=[1], admitted=[admit(5, 1)], decodes=[2, 3, 5]), (PATCH_ROWS, DECODE_GRAPH, PIECEWISE),
         PATCH_ROWS),                                      # 5 takes 1's row
        (StepPlan(8, admitted=[admit(4, 20)], extends=[ExtendItem(4, 0, 20, True)], decodes=[2, 3, 5]), (EAGER,),
         EAGER),
        (StepPlan(9, decodes=[2, 3, 5, 4]), (DECODE_GRAPH, PIECEWISE), DECODE_GRAPH),
    ]
    for plan, candidates, path in script:
        before = counters()
        want, got = eager.step(plan), fast.step(plan)      # the fast runner last: its choice recorded last
        assert got.error is None and want.error is None, (got.error, want.error)
        assert chosen[-1].candidates == candidates, plan.step_id
        assert deltas[tuple(a - b for a, b in zip(counters(), before))] is path, plan.step_id
        assert dict(zip(got.rids, got.token_ids)) == dict(zip(want.rids, want.token_ids)), plan.step_id
