"""Routed experts (Mixtral, Qwen3-MoE): a sparse MLP that sends each token to ``top_k`` of ``E`` SwiGLU experts.

One layer's MLP, per token x [hidden]::

    logits = gate(x)                                   # [E], the router (replicated under tensor parallelism)
    p = softmax(logits in float32); w, ids = top_k(p)  # ids: the chosen experts, w: their weights
    w = w / sum(w)                                     # where the family renormalizes (Mixtral; norm_topk_prob)
    out = sum_j w_j * down_ids[j](silu(gate_ids[j](x)) * up_ids[j](x))

Softmax over every expert then top-k and renormalized is softmax over the top-k logits (Mixtral's
formulation); without renormalizing (Qwen3-MoE's ``norm_topk_prob`` false) the weights sum to less than 1.

The experts' weights are stacked: ``gate_up_proj`` [E, 2 * I, hidden] (each expert's gate rows, then its up
rows) and ``down_proj`` [E, hidden, I], ``I`` this rank's share of each expert's width (tensor parallelism:
``radixrelay.model.parallel``). The products group the tokens by expert: the (token, choice) pairs are sorted
by expert id and each expert multiplies its contiguous run of rows, on the CPU by a loop of per-expert
products (``grouped_experts_torch``), on CUDA by the Triton grouped GEMM of
``radixrelay.kernels.grouped_experts`` (two launches per layer for all experts, gate/up then down, planned
without a host sync so that CUDA graphs can capture it; not yet run inside a captured graph). The weighted sum over a token's choices is taken in float32, the weights kept in float32
(transformers' Qwen3-MoE rounds them to the model dtype first: the same numbers in float32, within a
rounding of the model dtype otherwise).

FP8 weights (``--quantization fp8``) are refused at load for a layer with routed experts (unless
``--fp8-keep-layers`` keeps it in the model dtype): the experts' products have no FP8 path yet.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixrelay.kernels.grouped_experts import combine, grouped_experts
from radixrelay.model.model_config import ModelConfig
from radixrelay.model.cpu_gemm import linear
from radixrelay.model.layers import Linear, fused
from radixrelay.model.parallel import TensorParallel
from radixrelay.model.quantization import Precision


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E] -> (ids int64 [T, top_k], weights float32 [T, top_k]), the heaviest choice first."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


def grouped_experts_torch(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                          down: torch.Tensor) -> torch.Tensor:
    """The experts' SwiGLU MLPs, tokens grouped by expert, in torch ops (the CPU path; it reads the expert
    counts on the host).

    x: [T, hidden]; ids: int [T, k]; weights: float32 [T, k]; gate_up: [E, 2 * I, hidden]; down: [E, hidden, I]
    -> [T, hidden], dtype of x."""
    k = ids.shape[1]
    inter = down.shape[2]
    flat = ids.reshape(-1)                                               # [T * k], (token, choice) order
    order = torch.argsort(flat, stable=True)                             # pairs sorted by expert
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    rows = x[order // k]                                                 # [T * k, hidden], sorted
    out = torch.empty_like(rows)
    start = 0
    for e, n in enumerate(counts):
        if n:
            part = rows[start:start + n]
            w = gate_up[e]
            if part.device.type == "cpu":            # two products over the halves: faster for a few rows
                gate, up = linear(part, w[:inter]), linear(part, w[inter:])
            else:
                gate, up = linear(part, w).chunk(2, dim=-1)
            out[start:start + n] = linear(F.silu(gate) * up, down[e])
        start += n
    unsorted = torch.empty_like(out)
    unsorted[order] = out                                                # back to (token, choice) order
    return combine(unsorted, weights, x.dtype)


class Experts(nn.Module):
    """``E`` SwiGLU experts' weights, stacked (this rank's share of each expert's width)."""

    def __init__(self, num_experts: int, hidden: int, inter: int, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        self.num_experts, self.inter = num_experts, inter
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden, **factory))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter, **factory))

    def shard(self, param: str, shard: int) -> torch.Tensor:
        """The rows of ``param`` ("gate_up_proj" or "down_proj") that checkpoint tensor ``shard`` fills
        (``expert_shard``): an expert's gate or up half [I, hidden], or its down [hidden, I]."""
        if param == "down_proj":
            return self.down_proj.data[shard]
        expert, half = divmod(shard, 2)
        return self.gate_up_proj.data[expert].narrow(0, half * self.inter, self.inter)

    def shards(self, param: str) -> tuple[int, ...]:
        return tuple(range(self.num_experts * (2 if param == "gate_up_proj" else 1)))


_PROJECTIONS = {"gate_proj": 0, "up_proj": 1, "down_proj": 0}


def expert_shard(name: str) -> tuple[str, int] | None:
    """A per-expert checkpoint tensor (``<layer>.mlp.experts.<e>.<gate_proj|up_proj|down_proj>.weight``) -> (the
    stacked parameter it fills, its shard: ``2e`` / ``2e + 1`` for gate / up, ``e`` for down); None otherwise."""
    parts = name.split(".")
    if len(parts) < 5 or parts[-4] != "experts" or parts[-1] != "weight" or parts[-2] not in _PROJECTIONS:
        return None
    if not parts[-3].isdigit():
        return None
    expert, proj = int(parts[-3]), parts[-2]
    param = "down_proj" if proj == "down_proj" else "gate_up_proj"
    shard = expert if proj == "down_proj" else 2 * expert + _PROJECTIONS[proj]
    return ".".join(parts[:-3] + [param]), shard


class SparseMoE(nn.Module):
    """A routed-experts MLP; ``config``: one rank's shapes (its share of each expert's width). Same contract as
    the dense ``MLP``: ``partial(x)`` is this rank's share of the output."""

    def __init__(self, config: ModelConfig, tp: TensorParallel, precision: Precision, **factory) -> None:
        super().__init__()
        if precision.weights is not None:
            raise ValueError(f"quantization {precision.weights}: routed experts ({config.architecture}) are not "
                             f"supported in FP8 yet; serve the model in its dtype")
        self.tp = tp
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.moe_renormalize
        self.gate = Linear(config.hidden_size, config.num_experts, bias=False, **factory)      # the router
        self.experts = Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size, **factory)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> this rank's share of the experts' weighted sum [T, hidden]."""
        ids, weights = route(self.gate(x), self.top_k, self.renormalize)
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
        if fused(x):                        # CUDA: the grouped GEMM kernels (two launches, capturable)
            return grouped_experts(x, ids, weights, gate_up, down)
        return grouped_experts_torch(x, ids, weights, gate_up, down)
