"""The accept/reject rule of speculative decoding: drafted tokens checked against the target model's
distributions in one step, so that the tokens emitted are distributed exactly as the target's own
sampling, one token at a time (Leviathan et al. 2023, Chen et al. 2023).

Request b drafted ``n_b <= K`` tokens x_0..x_{n_b-1}, each drawn from a draft distribution q_i (or given
outright: a point mass, as n-gram and radix-tree drafts are); the step computed the target's distributions
p_0..p_{n_b} at the positions after the prefix and after each draft (p_i follows x_0..x_{i-1}). Then:

- x_i is kept while ``u_i * q_i(x_i) < p_i(x_i)`` (probability min(1, p_i(x_i) / q_i(x_i))), in order, up to
  the first rejection at j (j = n_b when every draft is kept);
- at j < n_b the next token is drawn from the residual max(p_j - q_j, 0), renormalised (p_j itself where the
  residual is all zero); at j = n_b, from p_j (the bonus token);
- the request emits x_0..x_{j-1} and that token: j + 1 tokens.

Greedy requests pass one-hot p (their argmax): a draft is kept while it is the argmax, and the token emitted
at the first mismatch is the argmax, so the output is token-identical with speculation off.

The randomness is given (``u_accept`` [B, K], ``u_sample`` [B], uniform in [0, 1)): the caller draws it from
each request's seed and position, so a seeded request draws the same tokens whatever its batch. (Not wired
into the step yet: speculative decoding's step model, several tokens per request, comes first.)
"""

from __future__ import annotations

import torch


def accept_drafts(target_probs: torch.Tensor, drafts: torch.Tensor, u_accept: torch.Tensor, u_sample: torch.Tensor,
                  *, draft_probs: torch.Tensor | None = None, num_drafts: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``target_probs`` float [B, K + 1, V] (rows sum to 1), ``drafts`` int64 [B, K], ``u_accept`` [B, K],
    ``u_sample`` [B]; ``draft_probs`` [B, K, V] (None: each draft a point mass), ``num_drafts`` int64 [B]
    (None: K each; the drafts past a row's count are ignored). Returns (``tokens`` int64 [B, K + 1]: a row's
    first ``num_emitted`` are its output, the rest unspecified; ``num_emitted`` int64 [B], in [1, n_b + 1])."""
    batch, k1, vocab = target_probs.shape
    k = k1 - 1
    if drafts.shape != (batch, k) or u_accept.shape != (batch, k) or u_sample.shape != (batch,):
        raise ValueError(f"shapes: target_probs {tuple(target_probs.shape)} needs drafts and u_accept of "
                         f"{(batch, k)} and u_sample of {(batch,)}; got {tuple(drafts.shape)}, "
                         f"{tuple(u_accept.shape)}, {tuple(u_sample.shape)}")
    if draft_probs is not None and draft_probs.shape != (batch, k, vocab):
        raise ValueError(f"draft_probs: expected {(batch, k, vocab)}, got {tuple(draft_probs.shape)}")
    rows = torch.arange(batch, device=drafts.device)
    counts = torch.full((batch,), k, dtype=torch.long, device=drafts.device) if num_drafts is None else \
        num_drafts.long()
    p_tok = target_probs[:, :k].gather(2, drafts[..., None]).squeeze(-1)                  # [B, K] p_i(x_i)
    q_tok = torch.ones_like(p_tok) if draft_probs is None else \
        draft_probs.gather(2, drafts[..., None]).squeeze(-1)                               # [B, K] q_i(x_i)
    drafted = torch.arange(k, device=drafts.device)[None, :] < counts[:, None]
    kept = (u_accept * q_tok < p_tok) & drafted
    j = kept.long().cumprod(dim=1).sum(dim=1)                                             # [B] drafts kept
    dist = target_probs[rows, j].clone()                                                  # [B, V] p_j
    rejected = j < counts
    if k and bool(rejected.any()):
        at = j.clamp(max=k - 1)
        if draft_probs is None:
            q_j = torch.zeros_like(dist)
            q_j[rows, drafts[rows, at]] = 1.0
        else:
            q_j = draft_probs[rows, at]
        residual = (dist - q_j).clamp(min=0)
        usable = rejected & (residual.sum(dim=1) > 0)
        dist = torch.where(usable[:, None], residual, dist)
    cdf = dist.cumsum(dim=1)                                                              # inverse-CDF draw
    picked = torch.searchsorted(cdf, (u_sample * cdf[:, -1])[:, None], right=True).squeeze(1).clamp(max=vocab - 1)
    tokens = torch.cat([drafts, drafts.new_zeros(batch, 1)], dim=1)
    tokens[rows, j] = picked
    return tokens, j + 1
