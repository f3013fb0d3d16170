"""KV oversubscribed on a CUDA machine: every request completes, greedy outputs unchanged, no OOM.

The Engine on Llama-3-8B shapes (dummy weights, ``--layers`` layers, the word-level tokenizer of
``bench_engine.py``): ``--requests`` prompts of ``--prompt`` random tokens, each generating
``--max-tokens`` greedy tokens, all submitted at once, first with a KV pool that holds every request,
then with one ``--oversubscription`` times smaller (the scheduler retracts and re-admits requests to
make room). Reported: completed, errors, retractions, and how many requests' tokens equal the large
pool's. Greedy equality across pools needs batch-invariant arithmetic (the two runs batch different
rows together); it is exact in float32, so that is the default dtype.

    python -m benchmarks.reliability.kv_oversubscribe [--layers 4] [--requests 64] [--oversubscription 4] [--out FILE]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time

from benchmarks.common import VOCAB, model_dir

from radixrelay import Engine, SamplingParams


def run(path: str, prompts: list[list[int]], max_tokens: int, kv_tokens: int, dtype: str) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    with Engine(model=path, load_format="dummy", device="cuda", dtype=dtype, kv_cache_tokens=kv_tokens) as engine:
        t0 = time.perf_counter()
        outs = engine.generate(prompts, params)
        wall = time.perf_counter() - t0
        stats = engine.stats()
    return {"wall_s": wall, "tokens": [o.token_ids for o in outs], "errors": [o.error for o in outs if o.error],
            "retractions": stats["num_retractions"],
            "kv_tokens": kv_tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--oversubscription", type=float, default=4.0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch

    rng = random.Random(0)
    prompts = [[rng.randrange(2, VOCAB) for _ in range(args.prompt)] for _ in range(args.requests)]
    demand = args.requests * (args.prompt + args.max_tokens)
    small = int(demand / args.oversubscription)
    with tempfile.TemporaryDirectory() as tmp:
        path = model_dir(tmp, args.layers)
        big = run(path, prompts, args.max_tokens, demand + 4096, args.dtype)
        tight = run(path, prompts, args.max_tokens, small, args.dtype)
    same = sum(a == b for a, b in zip(big["tokens"], tight["tokens"]))
    complete = sum(len(t) == args.max_tokens for t in tight["tokens"])
    lines = [f"# KV oversubscribed {args.oversubscription:g}x ({torch.cuda.get_device_name()})", "",
             f"Llama-3-8B shapes, {args.layers} layers, dummy {args.dtype} weights; {args.requests} requests of "
             f"{args.prompt} random tokens, {args.max_tokens} greedy tokens each, submitted together; KV demand "
             f"{demand:,} tokens. torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. "
             f"Command: `python -m benchmarks.reliability.kv_oversubscribe {' '.join(sys.argv[1:])}`.", "",
             "| KV pool (tokens) | wall s | completed | errors | retractions | greedy tokens equal to the large pool's |",
             "|---|---|---|---|---|---|",
             f"| {big['kv_tokens']:,} (holds all) | {big['wall_s']:.1f} | "
             f"{sum(len(t) == args.max_tokens for t in big['tokens'])}/{args.requests} | {len(big['errors'])} | "
             f"{big['retractions']} | - |",
             f"| {tight['kv_tokens']:,} | {tight['wall_s']:.1f} | {complete}/{args.requests} | {len(tight['errors'])} "
             f"| {tight['retractions']} | {same}/{args.requests} requests |"]
    text = "\n".join(lines) + "\n"
    print(text)
    if tight["errors"]:
        print("errors:", tight["errors"][:5])
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    sys.exit(0 if complete == args.requests and not tight["errors"] and same == args.requests else 1)


if __name__ == "__main__":
    main()
