"""Context overflow with ``--truncation`` (AttentionStore 3.4): the KV of the kept tokens re-positioned
from host memory vs recomputing the truncated prompt.

Each conversation: a first turn of ``--history`` tokens (fits the context), then a second turn that
adds ``--question`` tokens and overflows, so the oldest ``ratio x context`` tokens are dropped. Two
Engines serve the same token ids:
- ``reuse``: host tier on; the kept tokens' first pages are the first turn's KV, keys rotated;
- ``recompute``: no tiers; the truncated prompt is computed from scratch (token truncation).
Reports the second turn's TTFT (median over conversations, one token generated) and, over
``--gen`` greedy tokens, how often the two agree (exact sequences, and the mean matched prefix).

    python -m benchmarks.tiers.bench_truncation --out benchmarks/results/tiers/truncation_cpu.json     # default model, CPU
    python -m benchmarks.tiers.bench_truncation --gpu-8b --context 8192 --history 7800 ...      # dummy 8B, timing only
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from benchmarks.common import engine_tokenizer, gpu_8b_options, write_report
from radixrelay import Engine, SamplingParams
from radixrelay.bench.words import WORDS


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _conversations(tokenizer, args) -> list[tuple[list[int], list[int]]]:
    """(first-turn ids, second-turn tail ids) per conversation: exact token counts."""
    rng = random.Random(args.seed)
    out = []
    for i in range(args.conversations):
        first = tokenizer.encode(f"Conversation {i}. " + _text(rng, args.history))[:args.history]
        tail = tokenizer.encode(" Question: " + _text(rng, args.question) + "?")[:args.question]
        out.append((first, tail))
    return out


def run(engine_options: dict, convs, args) -> dict:
    greedy = SamplingParams(max_tokens=max(1, args.gen), temperature=0)
    one = SamplingParams(max_tokens=1, temperature=0)
    warm = SamplingParams(max_tokens=args.answer, temperature=0)
    ttft, outputs, reused = [], [], []
    with Engine(**engine_options) as eng:
        eng.generate([convs[0][0][:64]], one)                  # warm-up
        for first, tail in convs:
            answer = eng.generate([first], warm)[0].token_ids
            second = first + list(answer) + tail
            before = eng.stats()["tier_repositioned_tokens"]
            t0 = time.perf_counter()
            eng.generate([second], one)
            ttft.append((time.perf_counter() - t0) * 1e3)
            reused.append(eng.stats()["tier_repositioned_tokens"] - before)
            eng.flush_cache()                                   # the greedy run below starts equal
            outputs.append(eng.generate([second], greedy)[0].token_ids if args.gen else [])
    return {"ttft_ms": ttft, "ttft_p50_ms": statistics.median(ttft), "repositioned_tokens": reused,
            "outputs": outputs}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--ratio", type=float, default=0.5)
    p.add_argument("--history", type=int, default=440, help="first-turn tokens")
    p.add_argument("--answer", type=int, default=8, help="first-turn generated tokens")
    p.add_argument("--question", type=int, default=80, help="second-turn new tokens")
    p.add_argument("--gen", type=int, default=32, help="greedy tokens compared (0: timing only)")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--host-kv-gib", type=float, default=0.5)
    p.add_argument("--gpu-8b", action="store_true", help="Llama-3-8B shapes, dummy weights, on CUDA")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    base = dict(context_length=args.context, truncation=args.ratio,
                kv_cache_tokens=max(4 * args.context, 4096))
    if args.gpu_8b:
        base.update(gpu_8b_options(Path("/tmp/bench_truncation")))
    tokenizer = engine_tokenizer(base)
    convs = _conversations(tokenizer, args)
    reuse = run({**base, "host_kv_gib": args.host_kv_gib}, convs, args)
    recompute = run({**base, "host_kv_gib": 0}, convs, args)
    exact = [a == b for a, b in zip(reuse["outputs"], recompute["outputs"])]
    prefix = []
    for a, b in zip(reuse["outputs"], recompute["outputs"]):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(n / max(1, args.gen))
    report = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "ttft_p50_ms": {"reuse": reuse["ttft_p50_ms"], "recompute": recompute["ttft_p50_ms"]},
        "ttft_reduction": 1 - reuse["ttft_p50_ms"] / recompute["ttft_p50_ms"],
        "repositioned_tokens_median": statistics.median(reuse["repositioned_tokens"]),
        "greedy_exact_match_rate": sum(exact) / len(exact) if args.gen else None,
        "greedy_mean_matched_prefix": statistics.mean(prefix) if args.gen else None,
        "ttft_ms": {"reuse": reuse["ttft_ms"], "recompute": recompute["ttft_ms"]},
    }
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
