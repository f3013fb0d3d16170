"""The accept/reject rule of speculative decoding (``radixrelay.worker.speculative``): what it emits is
distributed as the target's own sampling, whatever the drafts; greedy targets keep exactly the drafts that
are their argmax."""

from __future__ import annotations

import pytest
import torch

from radixrelay.worker.speculative import accept_drafts

V, K, N = 5, 3, 200_000          # vocabulary, drafts a row, trials (rows)


def _sample(probs: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.multinomial(probs, n, replacement=True, generator=gen)


def _two_tokens(draft_probs: torch.Tensor | None, num_drafts: torch.Tensor | None, seed: int):
    """The first two output tokens of N generations whose first step speculates: with a target whose
    position distributions p_0, p_1 do not depend on the prefix, they must be independent draws of p_0 and
    p_1. A row that emitted one token samples its second from p_1 (the next step)."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.distributions.Dirichlet(torch.ones(V)).sample((K + 1,))                 # [K + 1, V]
    if draft_probs is None:        # point-mass drafts from a distribution unlike p
        drafts = _sample(torch.tensor([0.5, 0.05, 0.05, 0.1, 0.3]), N * K, gen).view(N, K)
        q = None
    else:
        q = draft_probs.expand(N, K, V)
        drafts = torch.stack([_sample(draft_probs[i], N, gen) for i in range(K)], dim=1)
    target = p.expand(N, K + 1, V)
    tokens, emitted = accept_drafts(target, drafts, torch.rand(N, K, generator=gen), torch.rand(N, generator=gen),
                                    draft_probs=q, num_drafts=num_drafts)
    second = torch.where(emitted >= 2, tokens[:, 1], _sample(p[1], N, gen))
    joint = torch.zeros(V, V)
    joint.index_put_((tokens[:, 0], second), torch.ones(N), accumulate=True)
    return joint / N, torch.outer(p[0], p[1]), emitted


@pytest.mark.parametrize("kind", ["point mass", "draft distribution", "some rows without drafts"])
def test_the_output_is_distributed_as_the_target(kind):
    torch.manual_seed(1)
    draft_probs = torch.distributions.Dirichlet(torch.ones(V)).sample((K,)) if kind == "draft distribution" else None
    counts = torch.randint(0, K + 1, (N,), generator=torch.Generator().manual_seed(2)) \
        if kind == "some rows without drafts" else None
    joint, want, emitted = _two_tokens(draft_probs, counts, seed=3)
    assert (joint - want).abs().sum() / 2 < 0.01                         # total variation over 25 cells
    assert emitted.min() >= 1 and emitted.max() <= K + 1 and float(emitted.float().mean()) > 1.1
    if counts is not None:
        assert bool((emitted <= counts + 1).all())


def test_a_rule_that_kept_every_draft_would_fail_the_check():
    """The check bites: emitting the drafts whatever p says is far from the target."""
    gen = torch.Generator().manual_seed(4)
    p = torch.distributions.Dirichlet(torch.ones(V)).sample((K + 1,))
    drafts = _sample(torch.tensor([0.5, 0.05, 0.05, 0.1, 0.3]), N * K, gen).view(N, K)
    joint = torch.zeros(V, V)
    joint.index_put_((drafts[:, 0], drafts[:, 1]), torch.ones(N), accumulate=True)
    assert (joint / N - torch.outer(p[0], p[1])).abs().sum() / 2 > 0.05


def test_greedy_keeps_the_drafts_that_are_the_argmax():
    argmax = torch.tensor([[2, 0, 4, 1], [3, 3, 1, 0], [1, 2, 2, 2]])          # the target's, K + 1 positions
    target = torch.nn.functional.one_hot(argmax, V).float()
    drafts = torch.tensor([[2, 0, 3], [3, 1, 1], [1, 2, 2]])
    u = torch.rand(3, K)
    tokens, emitted = accept_drafts(target, drafts, u, torch.rand(3))
    assert emitted.tolist() == [3, 2, 4]
    for row, n in enumerate(emitted.tolist()):
        assert tokens[row, :n].tolist() == argmax[row, :n].tolist()
    short, n_short = accept_drafts(target, drafts, u, torch.rand(3), num_drafts=torch.tensor([1, 0, 2]))
    assert n_short.tolist() == [2, 1, 3] and short[2, :3].tolist() == [1, 2, 2]


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="shapes"):
        accept_drafts(torch.ones(2, K + 1, V) / V, torch.zeros(2, K + 1, dtype=torch.long), torch.rand(2, K),
                      torch.rand(2))
