"""Prompt modules (Prompt Cache) vs prefix-only caching vs no cache: TTFT on a RAG-like workload, and how
often the modular (approximate) prompt gives the same output as the plain prompt.

Workload: ``--docs`` documents of ``--doc-tokens LO HI`` tokens, each stating one fact ("the code of
vault 17 is 4821"), in ``--slots`` unions (documents of one union share positions, so a schema of many
documents fits the model's context); each prompt imports ``--per-prompt LO HI`` documents from distinct
unions, in random order, then asks for the code of one of them. Three ways to serve the same prompt,
one Engine, requests one at a time (idle-server TTFT, one token generated):
- ``modules``: the prompt against the schema (``prompt_schema``): spans from module KV, new text computed;
- ``prefix``: the same documents and question as plain text, with the radix prefix cache;
- ``none``: the plain text with the cache flushed before each request;
- ``cached``: the plain text again right after ``prefix`` (all cached but its last token): the floor.
Before timing, every document is used once in each mode's way (module spans encoded; for ``prefix``,
intro + that document cached as a prefix), as a server that has seen its corpus would have them.

Agreement (``--gen`` > 0): greedy outputs of ``modules`` vs the plain prompt (exact, the uncached
output) over ``--gen`` tokens: mean fraction of matching positions, exact-sequence rate, and QA
exact match (the output contains the asked code) for both.

    python -m benchmarks.modules.bench_modules --out benchmarks/results/modules/modules_cpu.json          # default model, CPU
    python -m benchmarks.modules.bench_modules --gpu-8b --docs 100 --doc-tokens 700 1000 --per-prompt 5 5 --gen 0 ...
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

INTRO = "You answer questions using the documents below. Reply with the code only.\n"


def corpus(tokenizer, args) -> tuple[str, list[dict]]:
    """(schema PML, documents: name, slot, text, code)."""
    rng = random.Random(args.seed)
    docs = []
    for i in range(args.docs):
        code = str(rng.randrange(1000, 10000))
        target = rng.randint(*args.doc_tokens)
        head = f"Document {i}. The code of vault {i} is {code}. "
        words: list[str] = []
        text = head
        while len(tokenizer.encode(text, add_special_tokens=False)) < target:
            words.extend(rng.choice(WORDS) for _ in range(32))
            text = head + " ".join(words)
        while len(tokenizer.encode(text, add_special_tokens=False)) > target and words:
            words = words[:-4]
            text = head + " ".join(words)
        docs.append({"name": f"d{i}", "slot": i % args.slots, "text": text + "\n", "code": code})
    unions = "".join("<union>" + "".join(f'<module name="{d["name"]}">{d["text"]}</module>'
                                          for d in docs if d["slot"] == s) + "</union>"
                     for s in range(args.slots))
    return f'<schema name="rag"><module name="intro">{INTRO}</module>{unions}</schema>', docs


def prompts(docs: list[dict], args) -> list[dict]:
    rng = random.Random(args.seed + 1)
    by_slot: dict[int, list[dict]] = {}
    for d in docs:
        by_slot.setdefault(d["slot"], []).append(d)
    out = []
    for _ in range(args.prompts):
        k = rng.randint(*args.per_prompt)
        chosen = [rng.choice(by_slot[s]) for s in rng.sample(sorted(by_slot), k)]   # random order
        asked = rng.choice(chosen)
        question = f"Question: what is the code of vault {asked['name'][1:]}? Answer:"
        pml = ('<prompt schema="rag"><intro/>' + "".join(f"<{d['name']}/>" for d in chosen)
               + question + "</prompt>")
        plain = INTRO + "".join(d["text"] for d in chosen) + question
        out.append({"pml": pml, "plain": plain, "code": asked["code"]})
    return out


def _timed(fn) -> float:
    """Wall time of ``fn()`` (a one-request generate) in ms; a failed request is an error, not a time."""
    t0 = time.perf_counter()
    out = fn()[0]
    ms = (time.perf_counter() - t0) * 1e3
    if out.error is not None or out.completion_tokens != 1:
        raise RuntimeError(f"request failed: {out.finish_reason} {out.error}")
    return ms


BREAKDOWN = ("steps", "worker_busy_s", "worker_launch_s", "worker_device_s", "scheduler_busy_s")


class _Breakdown:
    """Per mode, the engine's step counters over its timed requests (``Engine.stats()`` deltas, read
    outside the timed window): where a request's milliseconds go (device, host launch, scheduler)."""

    def __init__(self, eng: Engine) -> None:
        self.eng = eng
        self.sums: dict[str, dict[str, float]] = {}
        self.counts: dict[str, int] = {}

    def timed(self, mode: str, fn) -> float:
        before = self.eng.stats()
        ms = _timed(fn)
        after = self.eng.stats()
        acc = self.sums.setdefault(mode, dict.fromkeys(BREAKDOWN, 0.0))
        for k in BREAKDOWN:
            acc[k] += after[k] - before[k]
        self.counts[mode] = self.counts.get(mode, 0) + 1
        return ms

    def report(self) -> dict[str, dict[str, float]]:
        """Per request means; seconds as ms."""
        return {mode: {(k[:-2] + "_ms" if k.endswith("_s") else k): (v * 1e3 if k.endswith("_s") else v)
                       / self.counts[mode] for k, v in acc.items()} for mode, acc in self.sums.items()}


def _flush(eng: Engine) -> None:
    """Empty the radix cache (retried while the scheduler still holds requests)."""
    for _ in range(500):
        if eng.flush_cache() and eng.stats()["cached_tokens"] == 0:
            return
        time.sleep(0.01)
    stats = eng.stats()
    raise RuntimeError(f"cache not flushed: {stats['num_running']} running, {stats['num_waiting']} waiting, "
                       f"{stats['cached_tokens']} cached, {stats['locked_tokens']} locked tokens")


def run(options: dict, schema: str, docs: list[dict], work: list[dict], args) -> dict:
    one = SamplingParams(max_tokens=1, temperature=0)
    greedy = SamplingParams(max_tokens=max(1, args.gen), temperature=0, ignore_eos=True)
    res: dict = {"ttft_ms": {"modules": [], "prefix": [], "cached": [], "none": []}}
    with Engine(**options) as eng:
        eng.register_schema(schema)
        eng.generate(["warm-up " * 8], one)
        lengths = [len(eng.schemas.compose("rag", w["pml"]).token_ids) for w in work]
        res["prompt_tokens_mean"] = statistics.mean(lengths)
        res["plain_tokens_mean"] = statistics.mean(len(eng.tokenizer.encode(w["plain"])) for w in work)
        for d in docs:      # every document seen once: spans encoded, intro + document cached as a prefix
            eng.generate(f'<prompt schema="rag"><{d["name"]}/>?</prompt>', one, prompt_schema="rag")
            eng.generate(INTRO + d["text"] + "?", one)
        parts = _Breakdown(eng)
        for w in work:
            res["ttft_ms"]["modules"].append(parts.timed("modules", lambda: eng.generate(w["pml"], one, prompt_schema="rag")))
            res["ttft_ms"]["prefix"].append(parts.timed("prefix", lambda: eng.generate(w["plain"], one)))
            res["ttft_ms"]["cached"].append(parts.timed("cached", lambda: eng.generate(w["plain"], one)))
        if args.gen:
            mod = [eng.generate(w["pml"], greedy, prompt_schema="rag")[0] for w in work]
            plain = [eng.generate(w["plain"], greedy)[0] for w in work]
            match = [sum(a == b for a, b in zip(m.token_ids, p.token_ids)) / args.gen for m, p in zip(mod, plain)]
            res["agreement"] = {
                "greedy_tokens": args.gen,
                "mean_matching_positions": statistics.mean(match),
                "exact_sequence_rate": statistics.mean(float(m.token_ids == p.token_ids) for m, p in zip(mod, plain)),
                "qa_exact_match_modules": statistics.mean(float(w["code"] in m.text) for w, m in zip(work, mod)),
                "qa_exact_match_plain": statistics.mean(float(w["code"] in p.text) for w, p in zip(work, plain)),
            }
        for w in work:
            _flush(eng)
            res["ttft_ms"]["none"].append(parts.timed("none", lambda: eng.generate(w["plain"], one)))
        res["breakdown_per_request"] = parts.report()
    res["ttft_p50_ms"] = {k: statistics.median(v) for k, v in res["ttft_ms"].items()}
    p50 = res["ttft_p50_ms"]
    res["speedup_vs_prefix"] = p50["prefix"] / p50["modules"]
    res["speedup_vs_none"] = p50["none"] / p50["modules"]
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, default=24)
    p.add_argument("--doc-tokens", type=int, nargs=2, default=(300, 600))
    p.add_argument("--slots", type=int, default=6, help="unions (documents of one share positions)")
    p.add_argument("--per-prompt", type=int, nargs=2, default=(3, 5))
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--gen", type=int, default=64, help="greedy tokens compared (0: timing only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-tokens", type=int, default=65536)
    p.add_argument("--gpu-8b", action="store_true", help="Llama-3-8B shapes, dummy weights, on CUDA")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    # No host tier: flush_cache() keeps the lower tiers' pages, so with one ``none`` would time a
    # promotion from host memory (~20 ms for 4.3K tokens of an 8B model), not a prefill.
    options: dict = dict(kv_cache_tokens=args.kv_cache_tokens, host_kv_gib=0)
    if args.gpu_8b:
        options.update(gpu_8b_options(Path("/tmp/bench_modules")))
    tokenizer = engine_tokenizer(options)
    schema, docs = corpus(tokenizer, args)
    work = prompts(docs, args)
    report = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              **run(options, schema, docs, work, args)}
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
