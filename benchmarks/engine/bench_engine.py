"""End to end through the Engine (scheduler, worker and tokenizer processes, radix cache, planner,
allocator, CUDA graphs): a document asked many questions, cascade off against auto.

Llama-3-8B shapes with dummy bf16 weights and a word-level tokenizer written here (no model files).
Per mode, one Engine: the document is read once (the first question: its prefill caches it); a
warm-up round of as many other questions (untimed: kernels compile, CUDA graphs are captured, as a
server does in its first minutes); then the questions arrive together; timed: that round, prefill
of the questions included. Then a round with half the output tokens: the difference is decode alone.
Both ``--repeats`` times with fresh questions; medians reported.

    python -m benchmarks.engine.bench_engine [--layers 32] [--doc 16384] [--questions 256] [--tp 1,2] [--out-dir DIR]

With ``--tp 1,2`` every mode runs once per tensor-parallel size (rows ``auto tp=2``); the report then goes
to ``engine_tp_<device>.md``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
import random
import sys
import tempfile
import time

from benchmarks.common import FAMILY_SHAPES, RESULTS, ROOT, VOCAB, model_dir

SHAPES = {"8b": {}, "70b": {"hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
                            "num_key_value_heads": 8}}
from radixrelay import Engine, SamplingParams
from radixrelay.bench.provenance import source_commit, write_device_results

def run(path: str, mode: str, doc: list[int], warmup: list[list[int]], fresh: Callable[[], list[list[int]]],
        max_tokens: int, kv_tokens: int, device: str, repeats: int, host_kv_gib: float | None = None,
        tp: int = 1) -> dict:
    """``repeats`` times: a timed round of fresh questions, then a round of other fresh questions with half
    the output tokens: the difference between the two is decode steps alone (same prefill, same first
    half of the decode). Reported: the round of median wall time, and the median decode step."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    half = SamplingParams(max_tokens=max_tokens // 2, temperature=0, ignore_eos=True)
    cascade, *flags = mode.split("-")               # e.g. "auto", "off-nooverlap", "auto-fa3", "auto-tritonnode"
    node_kernel = "fa3" if "fa3" in flags else "triton" if "tritonnode" in flags else "auto"
    rounds, decode = [], []
    with Engine(model=path, load_format="dummy", device=device, cascade=cascade, kv_cache_tokens=kv_tokens,
                disable_overlap="nooverlap" in flags, host_kv_gib=host_kv_gib, tp=tp,
                node_kernel=node_kernel) as engine:
        engine.generate([doc + warmup[0]], SamplingParams(max_tokens=2, ignore_eos=True))
        engine.generate([doc + q for q in warmup], params)
        for _ in range(repeats):
            before = engine.stats()
            t0 = time.perf_counter()
            outs = engine.generate([doc + q for q in fresh()], params)
            wall = time.perf_counter() - t0
            after = engine.stats()
            t1 = time.perf_counter()
            engine.generate([doc + q for q in fresh()], half)
            wall_half = time.perf_counter() - t1
            after_half = engine.stats()
            assert all(o.error is None and len(o.token_ids) == max_tokens for o in outs)
            rounds.append(_round(mode, outs, wall, before, after))
            full = {k: after[k] - before[k] for k in ("steps", "worker_device_s", "graph_captures")}
            part = {k: after_half[k] - after[k] for k in ("steps", "worker_device_s", "graph_captures")}
            steps = max(full["steps"] - part["steps"], 1)
            decode.append(((wall - wall_half) / steps, (full["worker_device_s"] - part["worker_device_s"]) / steps,
                           full["graph_captures"] - part["graph_captures"]))
    if tp > 1:
        rounds = [{**r, "mode": f"{mode} tp={tp}"} for r in rounds]
    row = sorted(rounds, key=lambda r: r["wall_s"])[len(rounds) // 2]
    step, device_s, captures = sorted(decode)[len(decode) // 2]
    return {**row, "decode_step_s": step, "decode_device_s": device_s, "decode_captures": captures,
            "walls": [r["wall_s"] for r in rounds], "decode_steps_s": [d[0] for d in decode]}


def _round(mode: str, outs, wall: float, before: dict, after: dict) -> dict:
    tokens = sum(len(o.token_ids) for o in outs)
    return {"mode": mode, "wall_s": wall, "tok_s": tokens / wall,
            "cached": sum(o.cached_tokens for o in outs) / len(outs),
            "computed": after["computed_tokens"] - before["computed_tokens"],
            "steps": after["steps"] - before["steps"],
            "cascade_steps": after["cascade_steps"] - before["cascade_steps"],
            "read_once": after["cascade_tokens_read_once"] - before["cascade_tokens_read_once"],
            **{k: after[k] - before[k] for k in ("worker_busy_s", "worker_launch_s", "scheduler_busy_s",
                                                 "worker_device_s", "graph_captures", "graph_replays",
                                                 "eager_steps", "tp_all_reduce_s")},
            # tensor parallelism: each rank's device seconds in the round
            "rank_device_s": [after[f"rank{r}_device_s"] - before[f"rank{r}_device_s"]
                              for r in range(sum(k.startswith("rank") and k.endswith("_device_s") for k in after))]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=("8b", "70b", *FAMILY_SHAPES), default="8b",
                    help="Llama-3 shapes, or another family's (benchmarks.common.FAMILY_SHAPES) (default: %(default)s)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--doc", type=int, default=16384)
    ap.add_argument("--questions", type=int, default=256)
    ap.add_argument("--question-len", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--modes", default="off,auto",
                    help="comma-separated cascade modes, each optionally suffixed -nooverlap (lock-step loop)")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run only (use tiny sizes)")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds per mode (medians reported)")
    ap.add_argument("--log-level", default="warning", help="of the engine's processes (info: graph captures)")
    ap.add_argument("--host-kv-gib", type=float, default=None,
                    help="host-memory KV tier (default: the Engine's, on for CUDA; 0: off)")
    ap.add_argument("--tp", default="1", help="comma-separated tensor-parallel sizes, each run with every mode")
    ap.add_argument("--out-dir", default=str(RESULTS / "engine"))
    args = ap.parse_args()

    import logging

    import torch

    logging.basicConfig(level=args.log_level.upper())      # the engine's processes take this level
    rng = random.Random(0)
    doc = [rng.randrange(2, VOCAB) for _ in range(args.doc)]
    def fresh() -> list[list[int]]:
        return [[rng.randrange(2, VOCAB) for _ in range(args.question_len)] for _ in range(args.questions)]

    warmup = fresh()
    kv_tokens = args.doc + 2 * args.questions * (args.question_len + args.max_tokens + 32) + 4096
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        family = FAMILY_SHAPES.get(args.shape)
        path = model_dir(tmp, args.layers, **(SHAPES[args.shape] if family is None else family[2]))
        for tp in map(int, args.tp.split(",")):
            for mode in args.modes.split(","):
                rows.append(run(path, mode, doc, warmup, fresh, args.max_tokens, kv_tokens, args.device, args.repeats,
                                args.host_kv_gib, tp))
                print(rows[-1], flush=True)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    shape_desc = f"Llama-3-{args.shape.upper()} shapes" if args.shape not in FAMILY_SHAPES else \
        FAMILY_SHAPES[args.shape][0]
    lines = [f"# Engine end to end: one document, many questions ({name})", "",
             f"{shape_desc}, {args.layers} layers, dummy bf16 weights; document {args.doc} tokens (read once "
             f"before the timed phase), {args.questions} questions of {args.question_len} tokens arriving together, "
             f"{args.max_tokens} output tokens each (greedy, EOS ignored), after an untimed warm-up round of as many "
             f"other questions; timed: the questions from submission to the last token, their prefill included "
             f"(the round of median wall time of {args.repeats}, each with fresh questions). "
             f"torch {torch.__version__}, "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit "
             f"{source_commit(ROOT)}. "
             f"Command: `python -m benchmarks.engine.bench_engine "
             f"{' '.join(sys.argv[1:])}`.", "",
             "| mode | wall s | output tok/s | vs first | cached tokens / request | computed tokens | steps | "
             "cascade steps | KV tokens read once |", "|---|---|---|---|---|---|---|---|---|"]
    timing = ["", "Per step (ms): wall time, the device's time (CUDA events) and its share of wall time, the worker's "
              "host time (launch, then waiting for and reading results) and of it the launch, the scheduler's work. "
              "With overlap the host parts run while the device computes the previous step.", "",
              "| mode | wall / step | device | device busy | busy per rank | all-reduce (rank 0) | worker | "
              "of which launch | scheduler | graph replays / captures / eager steps |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    base = rows[0]["tok_s"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['wall_s']:.2f} | {r['tok_s']:,.0f} | {r['tok_s'] / base:.2f}x | "
                     f"{r['cached']:,.0f} | {r['computed']:,} | {r['steps']} | {r['cascade_steps']} | "
                     f"{r['read_once']:,} |")
        ms = lambda x: 1e3 * x / r["steps"]  # noqa: E731
        per_rank = ", ".join(f"{d / r['wall_s']:.0%}" for d in r["rank_device_s"]) or "-"
        all_reduce = (f"{ms(r['tp_all_reduce_s']):.1f} ({r['tp_all_reduce_s'] / max(r['worker_device_s'], 1e-9):.0%})"
                      if r["rank_device_s"] else "-")
        timing.append(f"| {r['mode']} | {ms(r['wall_s']):.1f} | {ms(r['worker_device_s']):.1f} | "
                      f"{r['worker_device_s'] / r['wall_s']:.0%} | {per_rank} | {all_reduce} | {ms(r['worker_busy_s']):.1f} | "
                      f"{ms(r['worker_launch_s']):.1f} | {ms(r['scheduler_busy_s']):.1f} | "
                      f"{r['graph_replays']} / {r['graph_captures']} / {r['eager_steps']} |")
    lines += timing
    lines += ["", f"Decode alone: after each timed round, a round of {args.questions} other questions with "
              f"{args.max_tokens // 2} output tokens each; the difference between the two is decode steps only (ms "
              "per step, median over the repeats: wall, the device's time in those steps, wall over device; graph "
              "captures in the difference; every repeat's wall per step).", "",
              "| mode | decode step, wall | device | wall / device | captures | each repeat | round walls s |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {1e3 * r['decode_step_s']:.2f} | {1e3 * r['decode_device_s']:.2f} | "
                     f"{r['decode_step_s'] / max(r['decode_device_s'], 1e-9):.2f} | {r['decode_captures']} | "
                     f"{', '.join(f'{1e3 * x:.1f}' for x in r['decode_steps_s'])} | "
                     f"{', '.join(f'{x:.2f}' for x in r['walls'])} |")
    write_device_results(args.out_dir, "engine" if args.tp == "1" else "engine_tp", name, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
