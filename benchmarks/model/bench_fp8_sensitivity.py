"""Where FP8's accuracy goes on the default model (CPU): top-1 agreement with the unquantized model when the
decoder's linear layers round their weights (per output channel) and inputs (per token) to fewer mantissa
bits, and when only some layers are quantized.

The text, windows and agreement are ``bench_fp8_accuracy``'s. A row's values are scaled so that its largest
magnitude lands on 448 (e4m3's largest value), then rounded to ``m`` mantissa bits, ties to even, exponents
below 2^-6 as subnormals: ``m = 3`` is e4m3 itself (the cast), larger ``m`` a float of the same range with
more precision. The product runs in float32 on the rounded operands, as the emulation's does.

    python -m benchmarks.model.bench_fp8_sensitivity [--tokens 4096] [--bits 3,4,5,6] [--layers]
        --layers: e4m3 in one layer at a time (the others unquantized), then in all but the most
                  sensitive one and all but it and layer 0

Prints its tables (``fp8_accuracy_cpu.md`` keeps them, with the command).
"""

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.nn as nn

from benchmarks.model.bench_fp8_accuracy import score, text_tokens
from radixrelay.model import load_model
from radixrelay.model.fp8 import E4M3_MAX


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=2048)
    p.add_argument("--bits", default="3,4,5,6", help="mantissa bits to sweep (3: e4m3)")
    p.add_argument("--layers", action="store_true", help="also e4m3 in one layer at a time")
    args = p.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    ids = text_tokens(args.tokens)
    base, _ = load_model("default")
    ref, base_nll, count, _ = score(base, ids, args.window, False, None)

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
