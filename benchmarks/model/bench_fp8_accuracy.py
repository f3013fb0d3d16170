"""FP8 accuracy on the default model, CPU emulation: next-token agreement and perplexity against the
unquantized model over a fixed text.

The text: ``fp8_accuracy_text.txt`` beside this file, a frozen copy of this repository's documentation as of
b5e05a7 (README.md, then docs/*.md in name order, joined by blank lines), so the figures stay comparable when
the documentation changes; tokenized with the default model's tokenizer, cut into windows of ``--window`` tokens (each read from its own start) until
``--tokens`` tokens are scored. Every position of every window is scored, teacher-forced:
  top-1 agreement   the share of positions whose most likely next token equals the unquantized model's;
  perplexity        exp(mean negative log-likelihood of the text's actual next token), and its ratio to
                    the unquantized model's.
Configurations: FP8 weights (``quantization fp8``), FP8 KV (``kv_cache_dtype fp8``) and both, then the two
with FP8 weights again with the last decoder layer kept in the model dtype (``fp8_keep_layers (-1,)``), each as
``radixrelay.model.quantization`` emulates it in float32 (the GPU path computes the same quantization).
Targets (issue: FP8 on Hopper): agreement >= 95%, perplexity within 3%.

    python -m benchmarks.model.bench_fp8_accuracy [--tokens 20480] [--window 2048] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import RESULTS, ROOT
from radixrelay.attention import BatchRequest, KVCache, TorchBackend, build_forward_batch
from radixrelay.bench.provenance import source_commit
from radixrelay.config import EngineConfig
from radixrelay.model import load_model
from radixrelay.model.quantization import Precision
from radixrelay.text.tokenizer import load_tokenizer

TEXT = Path(__file__).with_name("fp8_accuracy_text.txt")
CONFIGS = {"fp8 weights": Precision(weights="fp8", emulate=True),
           "fp8 KV": Precision(kv="fp8", emulate=True),
           "fp8 weights + KV": Precision(weights="fp8", kv="fp8", emulate=True),
           "fp8 weights, last layer kept": Precision(weights="fp8", emulate=True, keep_layers=(-1,)),
           "fp8 weights + KV, last layer kept": Precision(weights="fp8", kv="fp8", emulate=True, keep_layers=(-1,))}


def text_tokens(limit: int) -> list[int]:
    from radixrelay.model.model_registry import tokenizer_path

    ids = load_tokenizer(tokenizer_path(EngineConfig())).encode(TEXT.read_text())
    if len(ids) < limit + 1:
        raise SystemExit(f"bench_fp8_accuracy: {TEXT.name} holds {len(ids)} tokens, fewer than {limit + 1}")
    return ids[:limit + 1]


@torch.no_grad()
def window_logits(model, ids: list[int], kv_emulation: bool) -> torch.Tensor:
    """ids: one window -> [len(ids), vocab] float32 logits of every position (one prefill)."""
    cfg = model.local_config
    page = 16
    pages = -(-len(ids) // page)
    cache = KVCache(num_layers=cfg.num_layers, num_pages=pages, page_size=page, num_kv_heads=cfg.num_kv_heads,
                    head_dim=cfg.head_dim, dtype=torch.float32, device="cpu")
    if kv_emulation:
        model.enable_kv_emulation(cache)
    batch = build_forward_batch([BatchRequest(list(range(pages)), 0, len(ids))], page, "cpu")
    batch = dataclasses.replace(batch, logits_indices=torch.arange(len(ids)))
    return model(torch.tensor(ids), batch, cache, TorchBackend())


def score(model, ids: list[int], window: int, kv_emulation: bool, reference: list[torch.Tensor] | None):
    """(per-window argmax, sum of NLL, positions, agreeing positions)."""
    argmaxes, nll, count, agree = [], 0.0, 0, 0
    for w, start in enumerate(range(0, len(ids) - 1, window)):
        chunk = ids[start:start + window + 1]
        logits = window_logits(model, chunk[:-1], kv_emulation)
        targets = torch.tensor(chunk[1:])
        nll += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
        top = logits.argmax(-1)
        argmaxes.append(top)
        count += len(targets)
        if reference is not None:
            agree += int((top == reference[w]).sum())
    return argmaxes, nll, count, agree


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=20480, help="positions scored")
    p.add_argument("--window", type=int, default=2048, help="tokens per window (context)")
    p.add_argument("--out-dir", default=str(RESULTS / "model"))
    args = p.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    ids = text_tokens(args.tokens)
    base, _ = load_model("default")
    start = time.perf_counter()
    ref, base_nll, count, _ = score(base, ids, args.window, False, None)
    base_ppl = math.exp(base_nll / count)
    rows = [f"| unquantized (float32) | - | {base_ppl:.3f} | 1.000 | {time.perf_counter() - start:.0f} |"]
    results = {}
    for name, precision in CONFIGS.items():
        model = base if precision.weights is None else load_model("default", precision=precision)[0]
        start = time.perf_counter()
        _, nll, _, agree = score(model, ids, args.window, precision.kv == "fp8", ref)
        ppl = math.exp(nll / count)
        results[name] = (agree / count, ppl / base_ppl)
        rows.append(f"| {name} | {100 * agree / count:.2f}% | {ppl:.3f} | {ppl / base_ppl:.4f} | "
                    f"{time.perf_counter() - start:.0f} |")
        print(rows[-1], flush=True)
    lines = ["# FP8 accuracy, default model (SmolLM2-135M-Instruct), CPU emulation", "",
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; commit {source_commit(ROOT)}; torch "
             f"{torch.__version__}. Command: `python -m benchmarks.model.bench_fp8_accuracy {' '.join(sys.argv[1:])}`", "",
             f"{count:,} positions of this repository's documentation (`{TEXT.name}`: README.md, docs/*.md as of "
             f"b5e05a7), windows of {args.window} "
             "tokens, teacher-forced; agreement: the most likely next token equals the unquantized model's; perplexity "
             "of the text's next token. FP8 as `radixrelay.model.quantization` emulates it: weights e4m3 per output "
             "channel x inputs e4m3 per token; KV e4m3 with per-layer scales (1.0: the default model has none); "
             "'last layer kept': the last decoder layer's projections unquantized (`fp8_keep_layers=(-1,)`). "
             "Targets: agreement >= 95%, perplexity within 3%.", "",
             "| configuration | top-1 agreement | perplexity | perplexity / unquantized | seconds |",
             "|---|---|---|---|---|", *rows, ""]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8_accuracy_cpu.md").write_text("\n".join(lines))
    print("\n".join(lines))
    missed = [n for n, (agree, ratio) in results.items() if agree < 0.95 or ratio > 1.03]
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
