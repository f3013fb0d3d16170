"""Host cost of admitting many long prompts through the Engine, on the CPU: the admission half of
``bench_engine.py`` (a cached document asked many questions at once) without its decode.

A tiny Llama-shaped dummy model (1 layer, hidden 32, 1 head, 1 KV head, head_dim 8: the CPU's attention
over the document stays small next to the admission) with Llama-3's vocabulary (128,256 ids, so token
ids are as large as the real benchmark's) and a word-level tokenizer written here. One Engine: the
document is read once (its prefill caches it), a warm-up round of questions, then timed rounds of fresh
questions (each prompt: the whole document + the question's new tokens) with ``max_tokens`` 1: the round
is the token ids crossing the processes, radix matching, page lists, the questions' small prefill.
Reported: the median wall time of a round, and the scheduler's and the worker's busy seconds of that
round (``Engine.stats()`` deltas). ``--host-kv-gib`` turns the host KV tier on (as on CUDA by default):
each question's pages are saved when it finishes, the document's through keys kept on the tree.

    python -m benchmarks.engine.bench_admission [--doc 16384] [--questions 256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

from benchmarks.common import VOCAB, model_dir
from radixrelay import Engine, SamplingParams


def tiny_model_dir(path: str) -> str:
    """Llama config with tiny shapes and Llama-3's vocabulary, and a word-level tokenizer ``w<i>``."""
    return model_dir(path, 1, hidden_size=32, intermediate_size=64, num_attention_heads=1, num_key_value_heads=1,
                     head_dim=8, torch_dtype="float32")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--doc", type=int, default=16384)
    ap.add_argument("--questions", type=int, default=256)
    ap.add_argument("--question-len", type=int, default=1,
                    help="new tokens per question (bench_engine.py: 24; here their prefill attention over the document, torch on the CPU, would swamp the admission)")
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds (medians reported)")
    ap.add_argument("--cascade", default="auto")
    ap.add_argument("--host-kv-gib", type=float, default=0.0,
                    help="host-memory KV tier (0: off, the CPU default; CUDA serves with it on): finished "
                         "requests save their pages, so the round includes the tiers' bookkeeping")
    args = ap.parse_args()

    rng = random.Random(0)
    doc = [rng.randrange(2, VOCAB) for _ in range(args.doc)]

    def fresh() -> list[list[int]]:
        return [doc + [rng.randrange(2, VOCAB) for _ in range(args.question_len)] for _ in range(args.questions)]

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    kv_tokens = args.doc + 2 * args.questions * (args.question_len + args.max_tokens + 32) + 4096
    keys = ("scheduler_busy_s", "worker_busy_s", "steps")
    rounds = []
    with tempfile.TemporaryDirectory() as tmp, \
            Engine(model=tiny_model_dir(tmp), load_format="dummy", device="cpu", cascade=args.cascade,
                   kv_cache_tokens=kv_tokens, host_kv_gib=args.host_kv_gib) as engine:
        engine.generate([doc + [2]], SamplingParams(max_tokens=1, ignore_eos=True))   # caches the document
        engine.generate(fresh(), params)                                            # warm-up round
        for _ in range(args.repeats):
            prompts = fresh()
            before = engine.stats()
            t0 = time.perf_counter()
            outs = engine.generate(prompts, params)
            wall = time.perf_counter() - t0
            after = engine.stats()
            assert all(o.error is None and len(o.token_ids) == args.max_tokens for o in outs)
            assert all(o.cached_tokens >= args.doc - 16 for o in outs)
            rounds.append({"wall_s": wall, **{k: after[k] - before[k] for k in keys}})
            print({k: round(v, 4) for k, v in rounds[-1].items()}, flush=True)
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    walls = ", ".join(f"{r['wall_s']:.3f}" for r in rounds)
    print(f"admission: {args.questions} x ({args.doc} cached + {args.question_len} new) tokens, "
          f"max_tokens {args.max_tokens}, {args.repeats} rounds, medians: wall {med['wall_s']:.3f} s, "
          f"scheduler busy {med['scheduler_busy_s']:.3f} s, worker busy {med['worker_busy_s']:.3f} s, "
          f"{med['steps']:.0f} steps; walls {walls}")


if __name__ == "__main__":
    main()
