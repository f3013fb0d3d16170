"""Where FP8's accuracy goes on the default model (CPU): top-1 agreement with the unquantized model when the
decoder's linear layers round their weights (per output channel) and inputs (per token) to fewer mantissa
bits, and when only some layers are quantized.

The text, windows and agreement are ``bench_fp8_accuracy``'s. A row's values are scaled so that its largest
magnitude lands on 448 (e4m3's largest value), then rounded to ``m`` mantissa bits, ties to even, exponents
below 2^-6 as subnormals: ``m = 3`` is e4m3 itself (the cast), larger ``m`` a float of the same range with
more precision. The product runs in float32 on the rounded operands, as the emulation's does.

    python -m benchmarks.model.bench_fp8_sensitivity [--tokens 4096] [--bits 3,4,5,6] [--layers] [--attention]
        --layers:    e4m3 in one layer at a time (the others unquantized), then in all but the most
                     sensitive one and all but it and layer 0
        --attention: instead, what an attention kernel on FP8 tensor cores adds to an FP8 KV cache (whose
                     values are rounded to e4m3 at scale 1 while the attention arithmetic stays float32): (a) the
                     queries in e4m3, one scale per (token, query head) row (amax / 448; the scores
                     (q8 . k) * scale), (b) the softmax probabilities p = exp(s - row max) in e4m3 (scale 1)
                     before P . V, the normaliser the float32 sum of the unrounded p; each alone and both,
                     with FP8 KV and with FP8 weights + KV (``bench_fp8_accuracy``'s ``Precision``s), then on
                     the unquantized model; the FP8 rows also give the emulation's float32 matmuls with nothing
                     rounded (the noise: see ``attention_table``). The whole row is one block (the row's final
                     max, where a kernel's running max may be lower). Default --tokens 20480
                     (``bench_fp8_accuracy``'s positions); the emulation's dense float32 matmuls are several
                     times slower than the CPU kernel (the 20,480 positions: ~50 minutes on 2 cores).

Prints its tables (``fp8_accuracy_cpu.md`` keeps them, with the command).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
from collections.abc import Iterator

import torch
import torch.nn as nn

from benchmarks.model.bench_fp8_accuracy import score, text_tokens
from radixrelay.attention import reference
from radixrelay.model import load_model
from radixrelay.kernels.fp8 import E4M3, E4M3_MAX
from radixrelay.model.quantization import Precision


def round_rows(x: torch.Tensor, mantissa_bits: int) -> torch.Tensor:
    """[R, C] -> float32 [R, C]: each row scaled to an amax of 448, rounded to ``mantissa_bits`` bits (e4m3's
    exponent floor: steps of 2^(-6 - bits) below 2^-6), scaled back. ``mantissa_bits = 3``: e4m3's cast."""
    x = x.float()
    amax = x.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))
    v = (x / scale).clamp(-E4M3_MAX, E4M3_MAX)
    if mantissa_bits == 3:
        return v.to(torch.float8_e4m3fn).float() * scale
    mag = v.abs()
    exp = torch.floor(torch.log2(torch.where(mag > 0, mag, torch.ones_like(mag)))).clamp(min=-6)
    step = torch.exp2(exp - mantissa_bits)
    rounded = torch.where(mag > 0, torch.round(mag / step) * step, torch.zeros_like(mag))
    return torch.copysign(rounded, v) * scale


class _RoundedInputs(nn.Module):
    """A linear layer whose input rows are rounded first (``round_rows``, per token)."""

    def __init__(self, inner: nn.Module, mantissa_bits: int) -> None:
        super().__init__()
        self.inner, self.mantissa_bits = inner, mantissa_bits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(round_rows(x.reshape(-1, x.shape[-1]), self.mantissa_bits).reshape(x.shape))


def rounded_model(mantissa_bits: int, layers: set[int] | None = None):
    """The default model (float32) with the linear layers of decoder ``layers`` (None: all) rounded."""
    model, _ = load_model("default")
    for i, layer in enumerate(model.model.layers):
        if layers is not None and i not in layers:
            continue
        parents = [(parent, name, child) for parent in layer.modules() for name, child in parent.named_children()
                   if hasattr(child, "weight") and child.weight is not None and child.weight.dim() == 2]
        for parent, name, child in parents:
            child.weight.data = round_rows(child.weight.data, mantissa_bits)
            setattr(parent, name, _RoundedInputs(child, mantissa_bits))
    return model


def fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, scale: float, *,
                  queries: bool, probs: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference._attend_matmul``'s shapes and result with an FP8 kernel's roundings. ``queries``: each query
    row (one token, one query head) scaled to an amax of 448 and cast to e4m3, the scores (q8 . k) * scale;
    ``probs``: p = exp(s - row max) cast to e4m3 (scale 1) before the product with V, divided by the sum of
    the unrounded p. Float32 products (q's dtype); a row that attends nothing gets o = 0, lse = -inf."""
    if queries:
        amax = q.abs().amax(-1, keepdim=True)
        q_scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        q8 = (q / q_scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).to(q.dtype)
        scores = torch.matmul(q8, k.transpose(-1, -2)).mul_(q_scale * scale)
    else:
        scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)                 # [B, H, L, S]
    if bias is not None:                                                            # None: no mask
        scores.add_(bias)
    row_max = scores.amax(-1, keepdim=True)
    row_max = torch.where(row_max.isinf(), 0.0, row_max)
    p = scores.sub_(row_max).exp_()
    total = p.sum(-1, keepdim=True)
    if probs:
        p = p.to(E4M3).to(q.dtype)
    o = torch.matmul(p, v) / torch.where(total > 0, total, 1.0)
    return o, (row_max + torch.log(total)).squeeze(-1)


@contextlib.contextmanager
def fp8_attention_arithmetic(queries: bool, probs: bool) -> Iterator[None]:
    """Within: the reference attention (every ``attend_planned``, so ``TorchBackend``) runs ``fp8_attention``."""
    kernel = reference._attend_folded
    reference._attend_folded = functools.partial(fp8_attention, queries=queries, probs=probs)
    try:
        yield
    finally:
        reference._attend_folded = kernel


def attention_table(ids: list[int], window: int, base, base_nll: float, ref: list[torch.Tensor],
                    count: int) -> None:
    """FP8 KV and FP8 weights + KV with the attention arithmetic as it is, with its float32 matmuls (the
    emulation's path, nothing rounded: an FP8 KV cache's rounding turns float32 noise into different K/V values
    downstream, so this row shows the noise), with (a), (b) and both; then (a), (b), both on the unquantized model."""
    print(f"{count:,} positions; ratios against the unquantized model (float32 attention)\n")
    print("| weights, KV | attention arithmetic | top-1 agreement | perplexity / unquantized |\n|---|---|---|---|")
    rounded = {"queries e4m3 (a)": (True, False), "P e4m3 (b)": (False, True), "queries + P e4m3 (a + b)": (True, True)}
    fp8_kv = {"float32 (as today)": None, "queries + P e4m3 (a + b)": (True, True),
              "float32 matmuls (nothing rounded)": (False, False), **rounded}
    fp8_weights = Precision(weights="fp8", emulate=True)
    for label, weights, kv, variants in (("float32, fp8", None, True, fp8_kv), ("fp8, fp8", fp8_weights, True, fp8_kv),
                                         ("float32, float32", None, False, rounded)):
        model = base if weights is None else load_model("default", precision=weights)[0]
        for arithmetic, rounding in variants.items():
            with contextlib.nullcontext() if rounding is None else fp8_attention_arithmetic(*rounding):
                _, nll, _, agree = score(model, ids, window, kv, ref)
            print(f"| {label} | {arithmetic} | {100 * agree / count:.2f}% | {math.exp((nll - base_nll) / count):.4f} |",
                  flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=None, help="positions scored (4096; 20480 with --attention)")
    p.add_argument("--window", type=int, default=2048)
    p.add_argument("--bits", default="3,4,5,6", help="mantissa bits to sweep (3: e4m3)")
    p.add_argument("--layers", action="store_true", help="also e4m3 in one layer at a time")
    p.add_argument("--attention", action="store_true", help="instead, FP8 queries and probabilities in attention")
    args = p.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    ids = text_tokens(args.tokens or (20480 if args.attention else 4096))
    base, _ = load_model("default")
    ref, base_nll, count, _ = score(base, ids, args.window, False, None)
    if args.attention:
        attention_table(ids, args.window, base, base_nll, ref, count)
        return 0

    def row(label: str, model) -> tuple[float, str]:
        _, nll, _, agree = score(model, ids, args.window, False, ref)
        line = f"| {label} | {100 * agree / count:.2f}% | {math.exp((nll - base_nll) / count):.4f} |"
        print(line, flush=True)
        return agree / count, line

    print(f"{count:,} positions, every decoder linear layer: weights per channel x inputs per token\n")
    print("| mantissa bits | top-1 agreement | perplexity / unquantized |\n|---|---|---|")
    for bits in (int(b) for b in args.bits.split(",")):
        row(f"{bits}{' (e4m3)' if bits == 3 else ''}", rounded_model(bits))
    if not args.layers:
        return 0
    print("\n| e4m3 in | top-1 agreement | perplexity / unquantized |\n|---|---|---|")
    num_layers = len(base.model.layers)
    alone = [row(f"layer {i} alone", rounded_model(3, {i}))[0] for i in range(num_layers)]
    worst = min(range(num_layers), key=alone.__getitem__)
    row(f"every layer but {worst}", rounded_model(3, set(range(num_layers)) - {worst}))
    row(f"every layer but 0 and {worst}", rounded_model(3, set(range(num_layers)) - {0, worst}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
