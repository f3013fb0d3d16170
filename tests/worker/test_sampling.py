"""Batched sampler: greedy, filters, seeds, penalties, logprobs (CPU, small vocabularies)."""

from __future__ import annotations

import math

import pytest
import torch

from radixrelay.sampling_params import SamplingParams
from radixrelay.worker.sampling import Sampler, SamplingTensors, apply_bias, apply_penalties

V = 64


def make(params: list[SamplingParams], token_ids=None, num_prompt=None) -> SamplingTensors:
    token_ids = token_ids or [[] for _ in params]
    num_prompt = num_prompt or [0 for _ in params]
    return SamplingTensors.build(params, token_ids, num_prompt, vocab_size=V, device="cpu")


def logits_for(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax() -> None:
    logits = logits_for(5)
    out = Sampler()(logits, make([SamplingParams(temperature=0)] * 5))
    assert torch.equal(out.token_ids, logits.argmax(-1)) and out.logprobs is None


def test_greedy_rows_mixed_with_sampled_rows() -> None:
    logits = logits_for(4)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=5.0)] * 2
    ids = Sampler(torch.Generator().manual_seed(1))(logits, make(params)).token_ids
    assert ids[0] == logits[0].argmax() and ids[2] == logits[2].argmax()


def allowed_set(row: torch.Tensor, p: SamplingParams) -> set[int]:
    """Reference filter for one row, written independently of the sampler (sort in Python)."""
    probs = torch.softmax(row / p.temperature, -1).tolist()
    order = sorted(range(V), key=lambda i: -probs[i])
    if p.top_k > 0:
        order = order[: p.top_k]
    kept, mass = [], 0.0
    total = sum(probs[i] for i in order)
    for i in order:
        if p.top_p < 1 and mass >= p.top_p:
            break
        kept.append(i)
        mass += probs[i] / total
    best = max(probs[i] for i in kept)
    return {i for i in kept if probs[i] >= p.min_p * best}


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(top_k=3),
        SamplingParams(top_p=0.5),
        SamplingParams(min_p=0.2),
        SamplingParams(top_k=10, top_p=0.7, min_p=0.05, temperature=1.5),
        SamplingParams(top_k=1, temperature=2.0),
    ],
)
def test_filters_never_pick_excluded_tokens(params: SamplingParams) -> None:
    rows, draws = 8, 400
    logits = logits_for(rows, seed=3)
    allowed = [allowed_set(logits[r], params) for r in range(rows)]
    batch = logits.repeat(draws, 1)  # [rows * draws, V]
    ids = Sampler(torch.Generator().manual_seed(0))(batch, make([params] * (rows * draws))).token_ids
    picked = ids.view(draws, rows)
    for r in range(rows):
        seen = set(picked[:, r].tolist())
        assert seen <= allowed[r]
        if len(allowed[r]) > 1:
            assert len(seen) > 1  # it does sample, not just argmax


def test_sampling_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2] + [1e-9] * (V - 3)]))
    n = 4000
    ids = Sampler(torch.Generator().manual_seed(0))(logits.repeat(n, 1), make([SamplingParams()] * n)).token_ids
    freq = torch.bincount(ids, minlength=V)[:3].float() / n
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2]), atol=0.03)


def test_seeded_rows_ignore_batch_mates() -> None:
    seeded = SamplingParams(seed=1234, temperature=1.0)
    target = logits_for(1, seed=7)
    alone = Sampler()(target, make([seeded])).token_ids
    mates = torch.cat([logits_for(5, seed=8), target, logits_for(2, seed=9)])
    params = [SamplingParams()] * 5 + [seeded] + [SamplingParams(seed=99)] * 2
    for _ in range(3):  # unseeded mates draw differently every time; the seeded row never does
        assert Sampler()(mates, make(params)).token_ids[5] == alone[0]


def test_a_batch_of_seeded_rows_draws_no_shared_noise() -> None:
    """Every row seeded: each draws its own noise and the sampler's generator is not advanced (a batch-wide
    draw would be thrown away: half the sampling time of such a batch on the CPU); with one unseeded row it
    is, and the seeded rows' tokens are the same either way."""
    logits = torch.randn(4, V)
    shared = torch.Generator().manual_seed(7)
    before = shared.get_state()
    seeded = [SamplingParams(temperature=1.0, seed=s) for s in range(4)]
    ids = Sampler(shared)(logits, make(seeded)).token_ids
    assert torch.equal(shared.get_state(), before)
    mixed = Sampler(shared)(logits, make(seeded[:3] + [SamplingParams(temperature=1.0)])).token_ids
    assert not torch.equal(shared.get_state(), before)
    assert torch.equal(mixed[:3], ids[:3])


def test_seed_stream_advances_with_position() -> None:
    logits = torch.zeros(1, V)  # uniform: the token is decided by the noise alone

    def tokens(seed: int, filler: int) -> list[int]:
        """Tokens drawn at output positions 0..7 (a 3-token prompt, then `pos` outputs)."""
        return [
            Sampler()(logits, make([SamplingParams(seed=seed)], [[filler] * (3 + pos)], [3])).token_ids.item()
            for pos in range(8)
        ]

    first = tokens(5, filler=1)
    assert len(set(first)) > 1  # each position draws afresh
    assert tokens(5, filler=2) == first  # the draw depends on seed and position, not on the ids
    assert tokens(6, filler=1) != first


def test_penalties_follow_their_definitions() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5] + [0.0] * (V - 4)])
    # prompt = [0, 1], output = [2, 2]: token 3 is unseen.
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    t = make([params], token_ids=[[0, 1, 2, 2]], num_prompt=[2])
    out = apply_penalties(logits, t.penalties)
    expected = logits.clone()
    expected[0, 0] = 2.0 / 2  # positive: divided (prompt token; frequency/presence ignore the prompt)
    expected[0, 1] = -2.0 * 2  # negative: multiplied
    expected[0, 2] = 1.0 / 2 - 0.5 * 2 - 0.25  # output twice
    assert torch.equal(out, expected)


def test_no_penalty_tensors_when_unused() -> None:
    assert make([SamplingParams(), SamplingParams(temperature=0)]).penalties is None


def test_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9] + [0.0] * (V - 2)])
    t = make([SamplingParams(temperature=0, presence_penalty=1.0)], token_ids=[[7, 0]], num_prompt=[1])
    assert Sampler()(logits, t).token_ids.item() == 1


def test_logprobs_are_raw_log_softmax() -> None:
    logits = logits_for(3, seed=11)
    params = [SamplingParams(logprobs=5, temperature=0.7), SamplingParams(), SamplingParams(logprobs=0, top_k=2)]
    out = Sampler(torch.Generator().manual_seed(0))(logits, make(params))
    reference = torch.log_softmax(logits, -1)
    rows = out.logprobs.to_protocol([p.logprobs for p in params])
    assert rows[1] is None and rows[2].top == []
    for r in (0, 2):
        assert math.isclose(rows[r].logprob, reference[r, out.token_ids[r]].item(), rel_tol=1e-6)
    top = rows[0].top
    assert [i for i, _ in top] == reference[0].topk(5).indices.tolist()
    assert all(math.isclose(lp, reference[0, i].item(), rel_tol=1e-6) for i, lp in top)
    assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
    assert sum(math.exp(lp) for _, lp in top) <= 1.0


def test_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="fp32"):
        Sampler()(torch.zeros(1, V, dtype=torch.float16), make([SamplingParams()]))
    with pytest.raises(ValueError, match="logit rows"):
        Sampler()(torch.zeros(2, V), make([SamplingParams()]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_seeded_rows_and_filters() -> None:
    logits = logits_for(6, seed=2).cuda()
    logits[3] = logits[0]                      # rows 0 and 3: same seed, position and logits
    params = [SamplingParams(seed=7, top_k=5), SamplingParams(top_p=0.5), SamplingParams(temperature=0)] * 2
    build = SamplingTensors.build(params, [[1, 2]] * 6, [1] * 6, vocab_size=V, device="cuda")
    first, second = Sampler()(logits, build).token_ids, Sampler()(logits, build).token_ids
    assert first.is_cuda and first[0] == second[0] == first[3]
    assert first[2] == logits[2].argmax() and first[0].item() in allowed_set(logits[0].cpu(), params[0])


def test_logit_bias_is_added_per_row_and_logprobs_stay_raw() -> None:
    logits = logits_for(3)
    params = [SamplingParams(temperature=0, logit_bias=((5, 100.0), (5, -30.0), (9, -1.5)), logprobs=1),
              SamplingParams(temperature=0),
              SamplingParams(temperature=2.0, seed=1, logit_bias=((11, 100.0),))]
    tensors = make(params)
    expected = logits.clone().double()
    expected[0, 5] += 70.0
    expected[0, 9] -= 1.5
    expected[2, 11] += 100.0
    assert torch.allclose(apply_bias(logits, tensors.bias).double(), expected, atol=1e-4)
    out = Sampler(torch.Generator().manual_seed(0))(logits, tensors)
    assert out.token_ids.tolist() == [5, int(logits[1].argmax()), 11]
    assert math.isclose(float(out.logprobs.sampled[0]), float(logits[0].log_softmax(-1)[5]), rel_tol=1e-5)
    assert make([SamplingParams()]).bias is None
