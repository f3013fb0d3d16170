"""The embedded default model on the CPU: radixrelay's Engine against transformers ``generate``.

Same prompts (token ids), greedy, exactly ``--new-tokens`` each (EOS ignored on both sides), float32,
the same torch thread count in both. Per batch size: one untimed warm-up generate of each system,
then ``--repeats`` rounds that alternate the systems (Engine, then each transformers attention
implementation); medians. One Engine stays alive for the whole run (start-up is not timed). Each
round uses its own prompts (a round tag at the start), so no round reuses another's cached prefix.

transformers loads the same GGUF (dequantized to float32) and generates with left padding, once with
the model's default attention implementation and once with ``sdpa``; the faster one is the baseline.

The GEMM floors: per batch size, the time of the model's matrix products alone for ``--new-tokens``
decode steps (every layer's projections and the LM head, on the model's weights, one row per
request), no attention, norms or host work; once as the Engine runs them on the CPU
(``radixrelay.model.cpu_gemm``: oneDNN by default) and once as transformers does (``F.linear``,
torch's BLAS). Neither system's step takes less than its floor.

    python -m benchmarks.engine.bench_cpu_engine [--batch-sizes 1,8,32] [--new-tokens 128] [--repeats 3]
                                          [--threads N] [--out benchmarks/results/engine/cpu_engine.md]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

from benchmarks.common import RESULTS

TOPICS = ["the history of tea", "how rainbows form", "why cats purr", "the rules of chess", "making bread at home",
          "the water cycle", "how vaccines work", "the planets of the solar system", "learning a new language",
          "the causes of tides", "how bicycles stay upright", "the life of honey bees", "volcanoes",
          "how a compiler works", "the French revolution", "photosynthesis", "the stock market", "black holes",
          "how to train for a marathon", "the printing press", "coral reefs", "how airplanes fly",
          "the invention of the telephone", "recycling plastic", "the Roman empire", "how the heart pumps blood",
          "earthquakes", "the origins of jazz", "how batteries store energy", "desert animals",
          "the moon landing", "how glaciers move"]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def prompts_for(tokenizer, batch: int, round_tag: str) -> list[list[int]]:
    texts = [f"[{round_tag}-{i}] Write a short essay about {TOPICS[i % len(TOPICS)]}." for i in range(batch)]
    return [tokenizer.encode(t) for t in texts]


def gemm_seconds(model, batch: int, steps: int, engine: bool, repeats: int = 3) -> float:
    """Seconds for ``steps`` decode steps' matrix products alone at ``batch`` rows (median of ``repeats``),
    on the weights of ``model`` (transformers). ``engine``: as the Engine runs them on the CPU
    (``radixrelay.model.cpu_gemm.linear``: per layer the fused q/k/v, o, fused gate/up and down
    projections, then the LM head); otherwise as transformers does (``F.linear`` for q, k, v, o, gate,
    up, down and the LM head). No attention, norms or host work: the floor of each system's step."""
    import torch
    import torch.nn.functional as F

    from radixrelay.model.cpu_gemm import linear

    mats = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        if engine:
            mats.append(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach().contiguous())
            mats.append(a.o_proj.weight.detach())
            mats.append(torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach().contiguous())
            mats.append(m.down_proj.weight.detach())
        else:
            mats += [w.detach() for w in (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight,
                                          m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight)]
    mats.append(model.lm_head.weight.detach())
    inputs = {n: torch.randn(batch, n) for n in {w.shape[1] for w in mats}}
    product = linear if engine else F.linear

    def step() -> None:
        for w in mats:
            product(inputs[w.shape[1]], w)

    times = []
    with torch.inference_mode():
        for _ in range(2):
            step()
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads for both (default: torch's own)")
    ap.add_argument("--hf-attn", default="default,sdpa", help="transformers attention implementations to try")
    ap.add_argument("--out", default=str(RESULTS / "engine" / "cpu_engine.md"))
    ap.add_argument("--label", default="", help="a note for the table's heading (e.g. 'before')")
    args = ap.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]

    if args.threads is not None:      # before torch loads here, and inherited by the Engine's worker
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        os.environ["MKL_NUM_THREADS"] = str(args.threads)
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from radixrelay import Engine, SamplingParams
    from radixrelay.model.cpu_gemm import cpu_gemm_mode
    from radixrelay.model.model_registry import resolve_model_path

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    path = resolve_model_path("default")
    hf_models: dict[str, object] = {}          # resolved implementation -> model (default: "<impl> (default)")
    for impl in args.hf_attn.split(","):
        kwargs = {} if impl == "default" else {"attn_implementation": impl}
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                     **kwargs).eval()
        name = model.config._attn_implementation
        if name not in {k.split()[0] for k in hf_models}:
            hf_models[f"{name} (default)" if impl == "default" else name] = model
    engine = Engine(model="default")
    tokenizer = engine.tokenizer
    n = args.new_tokens
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)

    def run_engine(prompts: list[list[int]]) -> list[list[int]]:
        outs = engine.generate(prompts, params)
        assert all(o.error is None and len(o.token_ids) == n for o in outs), [o.error for o in outs]
        return [list(o.token_ids) for o in outs]

    # No EOS at all (as ignore_eos; None would fall back to the model's): min_new_tokens would instead
    # mask EOS out and change the tokens.
    hf_config = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=[], pad_token_id=0)

    def run_hf(model, prompts: list[list[int]]) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            seq = model.generate(ids, attention_mask=mask, generation_config=hf_config)
        assert seq.shape[1] == width + n
        return seq[:, width:].tolist()

    systems = {"radixrelay": run_engine, **{f"hf {k}": (lambda p, m=m: run_hf(m, p)) for k, m in hf_models.items()}}
    rows = []
    for batch in batch_sizes:
        for fn in systems.values():
            fn(prompts_for(tokenizer, batch, "warm"))
        times: dict[str, list[float]] = {k: [] for k in systems}
        same = []
        for r in range(args.repeats):
            prompts = prompts_for(tokenizer, batch, f"r{r}")
            outs = {}
            for name, fn in systems.items():
                t0 = time.perf_counter()
                outs[name] = fn(prompts)
                times[name].append(time.perf_counter() - t0)
            ref = next(v for k, v in outs.items() if k.startswith("hf"))
            same.append(sum(a == b for a, b in zip(outs["radixrelay"], ref)) / batch)
        med = {k: statistics.median(v) for k, v in times.items()}
        best_hf = min((k for k in systems if k.startswith("hf")), key=med.get)
        hf_model = next(iter(hf_models.values()))
        floor = gemm_seconds(hf_model, batch, n, engine=True)
        hf_floor = gemm_seconds(hf_model, batch, n, engine=False)
        row = {"batch": batch, "med": med, "times": times, "best_hf": best_hf,
               "ratio": med[best_hf] / med["radixrelay"], "same": statistics.mean(same), "floor": floor,
               "hf_floor": hf_floor}
        rows.append(row)
        print(f"batch {batch}: " + ", ".join(f"{k} {batch * n / v:.1f} tok/s ({v:.2f} s)" for k, v in med.items())
              + f"; radixrelay / {best_hf}: {row['ratio']:.2f}x; identical outputs {row['same']:.0%}; "
              f"GEMMs alone {floor:.2f} s (radixrelay) vs {hf_floor:.2f} s (transformers)", flush=True)
    engine.close()

    hf_names = [k for k in systems if k.startswith("hf")]
    command = "python -m benchmarks.engine.bench_cpu_engine " + " ".join(sys.argv[1:])
    load = os.getloadavg()
    lines = [
        f"# CPU: radixrelay Engine vs transformers generate{(' (' + args.label + ')') if args.label else ''}",
        "",
        f"- machine: {cpu_model()}, {os.cpu_count()} CPUs; torch {torch.__version__}, {threads} torch threads "
        f"in both; transformers {__import__('transformers').__version__}",
        f"- date: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}; load average at the end: "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
        f"- command: `{command.strip()}`",
        f"- model: default (SmolLM2-135M-Instruct GGUF Q4_1, float32), greedy, {n} new tokens per request "
        f"(EOS ignored), {args.repeats} interleaved rounds, medians; Engine start-up and each system's first "
        "(warm-up) generate untimed",
        "",
        "| batch | radixrelay tok/s | " + " | ".join(f"{k} tok/s" for k in hf_names)
        + " | radixrelay / best hf | identical outputs | radixrelay GEMMs alone s | transformers GEMMs alone s |",
        "|---:|---:|" + "---:|" * len(hf_names) + "---:|---:|---:|---:|",
    ]
    for row in rows:
        tok = row["batch"] * n
        cells = [f"{tok / row['med']['radixrelay']:.1f}"]
        cells += [f"{tok / row['med'][k]:.1f}" + (" *" if k == row["best_hf"] else "") for k in hf_names]
        lines.append(f"| {row['batch']} | " + " | ".join(cells) + f" | {row['ratio']:.2f}x | {row['same']:.0%} | "
                     f"{row['floor']:.2f} | {row['hf_floor']:.2f} |")
    lines += ["", "\\* the faster transformers variant (the baseline of the ratio). Identical outputs: the share of "
              "requests whose tokens equal transformers' (batched, left-padded fp32 can differ in the last bits). "
              "GEMMs alone: the model's matrix products for the same decode steps and nothing else "
              "(`gemm_seconds`), as the Engine runs them on the CPU (`radixrelay.model.cpu_gemm`, mode "
              f"{cpu_gemm_mode()}) and as transformers does (`F.linear`): each system's floor.",
              "", "Per-round seconds:", ""]
    for row in rows:
        lines.append(f"- batch {row['batch']}: " + "; ".join(
            f"{k} " + ", ".join(f"{t:.2f}" for t in v) for k, v in row["times"].items()))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
