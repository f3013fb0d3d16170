"""What ``ModelRunner.launch`` keeps from one step to the next (device index rows, sampling tensors, decode
runs, queued page-table and token writes) changes no output: a scripted workload of admissions, page
appends, decode orders, cascade plans (kept, sent again by value, changed), releases and re-admissions,
seeded / penalised / logprob rows runs through a runner that keeps them and one that drops them before
every step, with identical logits and tokens, and as flat attention with the same tokens."""

from __future__ import annotations

import random

import msgspec
import pytest
import torch

from radixrelay.attention import KVCache, TorchBackend
from radixrelay.cascade.batch import DecodeRunsCache
from radixrelay.model import ModelConfig, load_model
from radixrelay.protocol.cascade import CascadeGroup, CascadePlan
from radixrelay.protocol.step import AdmittedRequest, ExtendItem, PageAppend, StepPlan
from radixrelay.sampling_params import SamplingParams
from radixrelay.worker.model_runner import ModelRunner
from radixrelay.worker.sampling import SamplingTensors, SamplingTensorsCache
from radixrelay.worker.step_state import ResidentTokens
from tests.cascade.harness import RecordingSampler

PS = 4
CFG = ModelConfig(architecture="llama", vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512)
SHARED = 5                                # shared pages: 20 cached tokens every request begins with
PARAMS = {
    1: SamplingParams(max_tokens=500, temperature=0),
    2: SamplingParams(max_tokens=500, temperature=0.8, seed=5),
    3: SamplingParams(max_tokens=500, temperature=0, logprobs=2),
    4: SamplingParams(max_tokens=500, temperature=1.0, top_k=10),
    5: SamplingParams(max_tokens=500, temperature=0.7, seed=9, repetition_penalty=1.2, frequency_penalty=0.3),
}


def make_runner(model) -> ModelRunner:
    kv = KVCache(num_layers=CFG.num_layers, num_pages=128, page_size=PS, num_kv_heads=CFG.num_kv_heads,
                 head_dim=CFG.head_dim, dtype=torch.float64, device="cpu")
    runner = ModelRunner(model, kv, TorchBackend(), seed=3)
    runner.sampler = RecordingSampler(runner.sampler)
    return runner


def drop_kept_state(runner: ModelRunner) -> None:
    """Forget everything kept between steps (what a runner without these caches would rebuild)."""
    runner._decode_runs = DecodeRunsCache(runner.page_size, runner.device)
    runner._sampling = SamplingTensorsCache()
    runner._tokens._forget_indices()
    runner._page_table._gathered = None


class Script:
    """The scheduler's side: token lists, page lists, plans."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.system = [self.rng.randrange(CFG.vocab_size) for _ in range(SHARED * PS)]
        self.tokens: dict[int, list[int]] = {}
        self.pages: dict[int, list[int]] = {}
        self.next_page = SHARED
        self.step_id = 0

    def take(self, n: int) -> list[int]:
        out = list(range(self.next_page, self.next_page + n))
        self.next_page += n
        return out

    def admit(self, rid: int, first: bool = False) -> tuple[AdmittedRequest, ExtendItem]:
        """``rid`` with a few own tokens after the shared pages (``first``: computes the shared part too)."""
        own = self.tokens.get(rid, [])[SHARED * PS:] or [self.rng.randrange(CFG.vocab_size)
                                                          for _ in range(self.rng.randint(1, 6))]
        self.tokens[rid] = self.system + own
        n = len(self.tokens[rid])
        self.pages[rid] = list(range(SHARED)) + self.take(-(-n // PS) - SHARED)
        offset = 0 if first else SHARED * PS
        req = AdmittedRequest(rid, self.tokens[rid][offset:], SHARED * PS + 1 if own else n, list(self.pages[rid]),
                              PARAMS[rid], token_offset=offset)
        return req, ExtendItem(rid, offset, n - offset, sample=True)

    def plan(self, decodes: list[int], cascade: CascadePlan | None, **diff) -> StepPlan:
        appends = []
        for rid in decodes:                       # the decode computes position len(tokens) - 1
            if (len(self.tokens[rid]) - 1) // PS >= len(self.pages[rid]):
                new = self.take(1)
                self.pages[rid].extend(new)
                appends.append(PageAppend(rid, new))
        plan = StepPlan(self.step_id, page_appends=appends, decodes=list(decodes), cascade=cascade, **diff)
        self.step_id += 1
        return plan

    def record(self, out) -> None:
        for rid, token in zip(out.rids, out.token_ids):
            self.tokens[rid].append(token)


def shared_group(rids: list[int], tokens: int = SHARED * PS) -> CascadePlan:
    return CascadePlan([CascadeGroup(list(rids), 0, tokens, 0)], dict.fromkeys(rids, tokens))


def two_levels(rids: list[int]) -> CascadePlan:
    return CascadePlan([CascadeGroup(list(rids), 0, 8, 0), CascadeGroup(list(rids[:3]), 8, 12, 1)],
                       {rid: 20 if rid in rids[:3] else 8 for rid in rids})


def scripted_steps(script: Script):
    """Yields plans; the caller runs each and feeds the output to ``script.record``."""
    req, ext = script.admit(1, first=True)
    yield script.plan([], None, admitted=[req], extends=[ext])
    admitted = [script.admit(rid) for rid in (2, 3, 4, 5)]
    yield script.plan([1], None, admitted=[a for a, _ in admitted], extends=[e for _, e in admitted])
    rids = [1, 2, 3, 4, 5]
    kept = shared_group(rids)
    for step in range(40):
        if step in (12, 26):                      # retracted and resumed: new own pages, same rid
            yield script.plan([r for r in rids if r != 2], shared_group([r for r in rids if r != 2]),
                              released=[2])
            req, ext = script.admit(2)
            yield script.plan([r for r in rids if r != 2], None, admitted=[req], extends=[ext])
            continue
        kind = step % 8
        order = rids if kind < 4 else rids[::-1] if kind < 6 else rids[2:] + rids[:2]
        if kind in (0, 1, 4):
            cascade = kept                         # the planner's object, reused
        elif kind in (2, 5):
            cascade = msgspec.msgpack.decode(msgspec.msgpack.encode(kept), type=CascadePlan)   # by value
        elif kind == 3:
            cascade = two_levels(order)
        elif kind == 6:
            cascade = shared_group(order[:3], 12)
        else:
            cascade = None
        yield script.plan(order, cascade)


@pytest.fixture(scope="module")
def model():
    net, _ = load_model(CFG, dtype=torch.float64, seed=11)
    return net


@pytest.mark.parametrize("seed", [0, 1])
def test_kept_state_changes_no_output(model, seed):
    kept, fresh, flat = make_runner(model), make_runner(model), make_runner(model)
    script = Script(seed)
    steps = changes = 0
    last_key = None
    for plan in scripted_steps(script):
        if plan.cascade is not None and plan.decodes:
            key = (plan.cascade, tuple(plan.decodes))
            changes += key != last_key or bool(plan.released or plan.admitted)
            last_key = key
        out = kept.step(plan)
        drop_kept_state(fresh)
        ref = fresh.step(plan)
        flat_out = flat.step(msgspec.structs.replace(plan, cascade=None))
        assert out.error is None and ref.error is None and flat_out.error is None, (out.error, ref.error)
        assert (out.rids, out.token_ids, out.logprobs) == (ref.rids, ref.token_ids, ref.logprobs)
        assert torch.equal(kept.sampler.last, fresh.sampler.last)
        assert (flat_out.rids, flat_out.token_ids) == (out.rids, out.token_ids)
        torch.testing.assert_close(flat.sampler.last, kept.sampler.last, rtol=0, atol=1e-10)   # fp64
        script.record(out)
        steps += 1
    assert steps > 40
    assert kept._decode_runs.builds == changes <= steps - 15     # kept across repeated plans, rebuilt on changes
    assert all(len(t) > SHARED * PS + 20 for t in script.tokens.values())


def test_stale_runs_are_not_reused_after_readmission(model):
    """Same plan value and decode order as the step before, but a member came back with other pages
    in between: the runner checks its pages again (and refuses a run it does not hold)."""
    runner = make_runner(model)
    script = Script(2)
    for _, plan in zip(range(6), scripted_steps(script)):
        out = runner.step(plan)
        assert out.error is None, out.error
        script.record(out)
    rids = [1, 2, 3, 4, 5]
    out = runner.step(script.plan(rids, shared_group(rids)))
    assert out.error is None
    script.record(out)
    # rid 3 leaves and is admitted again with a private copy of the shared prefix, decoding at once.
    pages = script.take(len(script.pages[3]))
    script.pages[3] = pages
    n = len(script.tokens[3])
    again = AdmittedRequest(3, script.tokens[3][-1:], n, pages, PARAMS[3], token_offset=n - 1)
    out = runner.step(script.plan(rids, shared_group(rids), released=[3], admitted=[again]))
    assert out.error is not None and "request 3 does not hold the run's pages" in out.error


def test_resident_tokens_rows_follow_release_and_readmission():
    tokens = ResidentTokens("cpu", vocab_size=16, rows=2)
    plain = SamplingParams()
    for key in (1, 2, 3):
        tokens.admit(key, [key, 10 + key], 1, plain)
    assert tokens.newest([3, 1]).tolist() == [13, 11]
    tokens.record([3, 1], torch.tensor([5, 6]))
    assert tokens.newest([3, 1]).tolist() == [5, 6]
    tokens.release(1)
    tokens.admit(4, [9], 1, plain)                 # takes key 1's row
    tokens.admit(1, [7], 1, plain)
    assert tokens.newest([3, 1]).tolist() == [5, 7] and tokens.newest([4]).tolist() == [9]
    tokens.admit(5, [8], 1, plain)
    tokens.release(5)                              # before its queued write was made
    tokens.admit(6, [2], 1, plain)
    assert tokens.newest([6, 4, 3, 1]).tolist() == [2, 9, 5, 7]


def test_resident_tokens_penalty_columns_follow_the_keys():
    tokens = ResidentTokens("cpu", vocab_size=8)
    pen = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5)
    tokens.admit(1, [1, 2], 1, SamplingParams())
    assert tokens.penalties([1]) is None
    tokens.admit(2, [3, 4, 4], 2, pen)
    got = tokens.penalties([1, 2])
    assert got.repetition[:, 0].tolist() == [1.0, 1.5] and got.frequency[:, 0].tolist() == [0.0, 0.5]
    assert got.output_counts[1].tolist() == [0, 0, 0, 0, 1, 0, 0, 0] and not got.seen[0].any()
    tokens.record([1, 2], torch.tensor([0, 4]))
    assert tokens.penalties([1, 2]).output_counts[1, 4].item() == 2     # counts read every step
    tokens.release(2)
    tokens.admit(2, [5], 1, SamplingParams(presence_penalty=1.0))
    got = tokens.penalties([1, 2])
    assert got.repetition[:, 0].tolist() == [1.0, 1.0] and got.presence[:, 0].tolist() == [0.0, 1.0]
    assert got.output_counts.sum().item() == 0


class Row:
    def __init__(self, params: SamplingParams, outputs: int) -> None:
        self.params, self.outputs = params, outputs


def _fields(t: SamplingTensors) -> tuple:
    tensors = tuple(None if x is None else x.tolist() for x in (t.greedy, t.temperatures, t.top_k, t.top_p, t.min_p))
    return tensors + (t.all_greedy, t.step_seeds, t.num_logprobs, t.penalties)


def test_sampling_tensors_cache_equals_from_rows():
    rows = [Row(SamplingParams(temperature=0), 3), Row(SamplingParams(temperature=0.5, seed=4, top_p=0.9), 0),
            Row(SamplingParams(temperature=1.0, top_k=5, logprobs=1), 7)]
    cache = SamplingTensorsCache()

    def get(batch):
        return cache.get(batch, lambda r: r.params, lambda r: r.outputs, None, vocab_size=32, device="cpu")

    def want(batch):
        return SamplingTensors.from_rows([r.params for r in batch], [r.outputs for r in batch], None,
                                         vocab_size=32, device="cpu")

    first = get(rows)
    assert _fields(first) == _fields(want(rows))
    for _ in range(3):                                   # the same rows: the seeded row's seed moves on
        for r in rows:
            r.outputs += 1
        got = get(list(rows))
        assert _fields(got) == _fields(want(rows)) and got.temperatures is first.temperatures
    swapped = rows[::-1]                                 # another order, then another row object
    assert _fields(get(swapped)) == _fields(want(swapped))
    other = [rows[0], Row(SamplingParams(temperature=0.3, min_p=0.1), 2), rows[2]]
    assert _fields(get(other)) == _fields(want(other))
    greedy = [Row(SamplingParams(temperature=0), 1)]
    assert get(greedy) is get(greedy)                    # nothing per step: the same object
