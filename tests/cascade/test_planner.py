"""The cascade planner on hand-built decode rows: exact groups and levels, the cost model, reuse."""

from __future__ import annotations

import msgspec
import pytest

from radixrelay.cascade.cost import ALWAYS, MIN_SAVED_TOKENS, CostModel
from radixrelay.cascade.planner import CascadePlanner, make_cascade_planner, plan_groups
from radixrelay.protocol.cascade import CascadeGroup, CascadePlan, DecodeRow, PathSegment
from radixrelay.protocol.step import StepPlan

PS = 4


def row(rid: int, nodes: list[tuple[int, int]], own: int = 3) -> DecodeRow:
    """nodes: (node_id, tokens) root first; the row has ``own`` private tokens after them."""
    path, start = [], 0
    for node_id, tokens in nodes:
        path.append(PathSegment(node_id, start, tokens))
        start += tokens
    return DecodeRow(rid, path, start + own)


def by_rids(plan: CascadePlan) -> dict[tuple[int, ...], tuple[int, int, int]]:
    return {tuple(g.rids): (g.start, g.num_tokens, g.level) for g in plan.groups}


def two_level_rows() -> list[DecodeRow]:
    # system prompt (node 1, 16 tokens) -> problems (nodes 2, 3: 8 tokens) -> 2 samples each; rid 9 has
    # only the system prompt, rid 8 nothing cached
    return [row(0, [(1, 16), (2, 8)]), row(1, [(1, 16), (2, 8)]), row(2, [(1, 16), (3, 8)]),
            row(3, [(1, 16), (3, 8)]), row(9, [(1, 16)]), row(8, [])]


def test_two_levels_exact_groups():
    plan = plan_groups(two_level_rows(), ALWAYS, PS)
    assert by_rids(plan) == {(0, 1, 2, 3, 9): (0, 16, 0), (0, 1): (16, 8, 1), (2, 3): (16, 8, 1)}
    assert plan.own_start == {0: 24, 1: 24, 2: 24, 3: 24, 9: 16}
    assert plan.num_levels == 2
    assert plan.tokens_read_once() == 4 * 16 + 8 + 8


def test_chain_of_nodes_with_the_same_sharers_is_one_group():
    rows = [row(0, [(1, 8), (2, 4), (3, 12)]), row(1, [(1, 8), (2, 4), (3, 12), (4, 4)])]
    plan = plan_groups(rows, ALWAYS, PS)
    assert by_rids(plan) == {(0, 1): (0, 24, 0)}
    assert plan.own_start == {0: 24, 1: 24}


def one_group(cost: CostModel, n: int, tokens: int) -> bool:
    return cost.worth_group(n, tokens) and cost.worth_plan((n - 1) * tokens)


def test_cost_model_thresholds_and_folding():
    # "a node of 30 tokens shared by 2 requests is cheaper to read twice"
    assert not CostModel().worth_group(2, 30)
    # the calibration points (benchmarks/results/engine/throughput_h200.md): one shared prefix x batch
    for n, tokens in [(64, 1024), (32, 2048), (64, 2048), (2, 30), (1, 10**6)]:
        assert not one_group(CostModel(), n, tokens)
    for n, tokens in [(32, 8192), (256, 1024), (128, 2048), (2, MIN_SAVED_TOKENS)]:
        assert one_group(CostModel(), n, tokens)
    # a plan must pay as a whole
    assert plan_groups(two_level_rows(), CostModel(min_saved_tokens=10**6, min_group_saved=1), PS) is None
    cost = CostModel(min_saved_tokens=1, min_group_saved=100)
    # root run: 5 rows x 16 tokens saves 64 < 100: rejected; each problem run then starts at 0 and
    # covers 24 tokens for 2 rows (saves 24): rejected too -> flat
    assert plan_groups(two_level_rows(), cost, PS) is None
    # a short root shared by many, a long node shared by two: the root folds into the deeper run
    rows = [row(0, [(1, 8), (2, 200)]), row(1, [(1, 8), (2, 200)]), row(2, [(1, 8)]), row(3, [(1, 8)])]
    plan = plan_groups(rows, cost, PS)
    assert by_rids(plan) == {(0, 1): (0, 208, 0)}
    assert plan.own_start == {0: 208, 1: 208}


def test_auto_mode_on_realistic_shapes():
    # workload (b): 2K few-shot prefix -> problems of 512 tokens -> 16 samples each: two levels
    rows = [row(r, [(1, 2048), (10 + r // 16, 512)]) for r in range(512)]
    plan = make_cascade_planner("auto", 16)(rows)
    groups = by_rids(plan)
    assert groups[tuple(range(512))] == (0, 2048, 0)
    assert groups[tuple(range(16))] == (2048, 512, 1) and len(groups) == 33
    assert plan.own_start[5] == 2560
    # the serving benchmark's tree: 16 samples under 256-token problems save 3,840 tokens a group: two levels
    rows = [row(r, [(1, 2048), (10 + r // 16, 256)]) for r in range(256)]
    plan = make_cascade_planner("auto", 16)(rows)
    assert plan.num_levels == 2 and len(plan.groups) == 17 and plan.own_start[5] == 2304
    # 16 samples under 128-token problems save 1,920 tokens a group: left to the own suffixes
    rows = [row(r, [(1, 2048), (10 + r // 16, 128)]) for r in range(512)]
    plan = make_cascade_planner("auto", 16)(rows)
    assert len(plan.groups) == 1 and plan.own_start[5] == 2048
    # small batches stay flat
    assert make_cascade_planner("auto", 16)([row(r, [(1, 1024)]) for r in range(64)]) is None
    assert make_cascade_planner("auto", 16)([row(0, [(1, 30)]), row(1, [(1, 30)])]) is None


def test_plan_is_reused_until_a_path_changes():
    planner = make_cascade_planner("on", PS)
    rows = two_level_rows()
    first = planner(rows)
    grown = [DecodeRow(r.rid, r.path, r.seq_len + 1) for r in rows]     # a decode step later
    assert planner(grown) is first
    # node 1 split at 8: the upper half gets a new id, every path through it gets one node deeper
    split = [DecodeRow(r.rid, [PathSegment(7, 0, 8), PathSegment(1, 8, 8), *r.path[1:]], r.seq_len)
             if r.path else r for r in rows]
    again = planner(split)
    assert again is not first and again == first            # same runs: the two halves form one chain
    assert planner([r for r in grown if r.rid != 3]) is not again   # a row left
    c = planner.counters
    assert (c.decode_steps, c.cascade_steps) == (4, 4) and c.max_levels == 2
    assert c.groups == 3 + 3 + 3 + 2                        # rid 2 alone under its problem


def test_modes():
    assert make_cascade_planner("off", 16) is None
    assert isinstance(make_cascade_planner("on", 16), CascadePlanner)
    with pytest.raises(ValueError):
        make_cascade_planner("sometimes", 16)
    with pytest.raises(ValueError, match="page boundary"):
        plan_groups([row(0, [(1, 6), (2, 8)]), row(1, [(1, 6), (2, 8)]), row(2, [(1, 6)])], ALWAYS, PS)


def test_cost_model_is_at_least_as_strict_as_the_kernels_rule():
    from radixrelay.kernels.cascade_decode import worth_cascading

    for n in (2, 16, 32, 64, 128, 256, 512):
        for tokens in (16, 512, 1024, 2048, 4096, 8192, 16384):
            assert not one_group(CostModel(), n, tokens) or worth_cascading(n, tokens)


def test_plan_travels_in_the_step_plan():
    plan = plan_groups(two_level_rows(), ALWAYS, PS)
    step = StepPlan(step_id=3, decodes=[0, 1, 2, 3, 9, 8], cascade=plan)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(step), type=StepPlan)
    assert decoded == step and isinstance(decoded.cascade.groups[0], CascadeGroup)


def test_split_at_page_breaks():
    from radixrelay.attention.metadata import SharedRun, build_shared_runs
    from radixrelay.cascade.batch import split_at_page_breaks

    run = SharedRun([0, 3], [10, 11, 12, 40, 41, 7], 16 * 6 - 5)     # 3 pieces, the last page partial
    pieces = split_at_page_breaks(run, 16, min_pages=1)
    assert [(p.pages, p.num_tokens) for p in pieces] == [([10, 11, 12], 48), ([40, 41], 32), ([7], 11)]
    assert all(p.rows == [0, 3] for p in pieces)
    assert sum(p.num_tokens for p in pieces) == run.num_tokens
    assert build_shared_runs(pieces, "cpu").contiguous and not build_shared_runs([run], "cpu").contiguous
    assert split_at_page_breaks(run, 16, min_pages=2) == [run]             # a piece is too short
    assert split_at_page_breaks(run, 16, min_pages=1, max_pieces=2) == [run]   # too many pieces
    whole = SharedRun([1, 2], list(range(5, 69)), 64 * 16)
    assert split_at_page_breaks(whole, 16) == [whole]                       # one piece already
    two = SharedRun([1, 2], list(range(100, 140)) + list(range(0, 40)), 80 * 16)
    assert [len(p.pages) for p in split_at_page_breaks(two, 16)] == [40, 40]   # default: >= 32 pages each


def test_debug_log_explains_each_level(caplog):
    rows = [row(r, [(1, 2048), (10 + r // 16, 256)]) for r in range(96)] + \
           [row(100 + r, [(1, 2048), (50 + r // 2, 64)]) for r in range(8)]
    with caplog.at_level("DEBUG", logger="radixrelay.cascade"):
        make_cascade_planner("auto", 16)(rows)
        make_cascade_planner("auto", 16)([row(0, [(1, 64)]), row(1, [(1, 64)])])
    cascaded, flat = [r.getMessage() for r in caplog.records]
    assert cascaded.startswith("cascade plan for 104 decode rows: cascaded")
    assert "level 0: 1 run(s) of 104-104 rows accepted, saving 210944 token reads" in cascaded
    assert "level 1: 6 run(s) of 16-16 rows accepted, saving 23040 token reads; 4 run(s) rejected " \
           "(best saves 64 < 2048 per group" in cascaded
    assert flat.startswith("cascade plan for 2 decode rows: flat (plan saves 0 < 131072 per step); level 0: 1 "
                           "run(s) rejected (best saves 64")
