"""A pinned system prompt under memory pressure: its hit ratio while unpinned traffic churns the KV cache.

Agents share a long system prompt (tool schemas, ~--system-tokens tokens); between two of their requests,
unpinned requests of unique prompts (--churn requests of --churn-tokens tokens each) push the pool
(--kv-cache-tokens) through more than its size. Two runs through the real server, the same traffic:

- ``pinned``: the agents' system message carries an Anthropic-style ``cache_control`` mark (``ttl`` 1h), so
  the prompt up to it is pinned (``--pinned-kv-tokens`` bounds what pins may hold);
- ``unpinned``: the same requests without the mark (the LRU cache alone).

Reported per run: the hit ratio of the system prompt (over the agents' requests after the first, the share
of its tokens served from the cache: ``usage.prompt_tokens_details.cached_tokens``, at most the system
prompt's length, over that length), the agents' TTFT p50 (max_tokens 1: latency), and the pin counters.

    python -m benchmarks.serving.bench_pinned --device cpu         # tiny dummy model
    python -m benchmarks.serving.bench_pinned --device cuda        # Llama-3-8B shapes, dummy bf16 weights

Results: ``pinned_<device>.md`` (and ``.json``) in --out-dir ($OUT if set, else benchmarks/results/serving/).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks.common import RESULTS, ROOT, Server, default_tokenizer, scrape
from benchmarks.serving.bench_long_doc import _model_dir, _server_tokenizer
from radixrelay.bench.words import WORDS

PIN_COUNTERS = ("radixrelay_pin_hits_total", "radixrelay_pin_yields_total", "radixrelay_pin_expiries_total",
                "radixrelay_pin_refusals_total", "radixrelay_radix_pinned_tokens")


def words(rng: np.random.Generator, tokenizer, tokens: int) -> str:
    """About ``tokens`` tokens of random words (cut to that many by the tokenizer)."""
    text = " ".join(rng.choice(WORDS, tokens))
    return tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:tokens], skip_special_tokens=True)


async def run(args: argparse.Namespace, base_url: str, system: str, pinned: bool, tokenizer) -> dict[str, Any]:
    rng = np.random.default_rng(args.seed)            # the same traffic in both runs
    mark = {"cache_control": {"type": "ephemeral", "ttl": "1h"}} if pinned else {}
    system_msg = {"role": "system", "content": [{"type": "text", "text": system, **mark}]}
    system_tokens = None
    hits, ttfts, errors = [], [], 0
    async with httpx.AsyncClient(timeout=args.request_timeout) as http:
        assert (await http.post(f"{base_url}/flush_cache")).status_code == 200
        before = await scrape(http, base_url)
        for i in range(args.agents):
            for _ in range(args.churn if i else 0):
                body = {"model": "m", "prompt": words(rng, tokenizer, args.churn_tokens), "max_tokens": 1}
                if (await http.post(f"{base_url}/v1/completions", json=body)).status_code != 200:
                    errors += 1
            user = {"role": "user", "content": " ".join(rng.choice(WORDS, 12))}
            body = {"model": "m", "messages": [system_msg, user], "max_tokens": 1, "temperature": 0}
            started = time.perf_counter()
            resp = await http.post(f"{base_url}/v1/chat/completions", json=body)
            if resp.status_code != 200:
                errors += 1
                continue
            ttfts.append(time.perf_counter() - started)
            usage = resp.json()["usage"]
            if system_tokens is None:           # the system prompt's tokens: what the user turn does not add
                tok = await http.post(f"{base_url}/tokenize", json={"messages": [system_msg]})
                system_tokens = tok.json()["count"]
                continue                        # the first request computes it
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            hits.append(min(cached, system_tokens) / system_tokens)
        after = await scrape(http, base_url)
    return {"run": "pinned" if pinned else "unpinned", "agent_requests": args.agents, "system_tokens": system_tokens,
            "hit_ratio": statistics.fmean(hits) if hits else None,
            "full_hits": sum(h >= 0.99 for h in hits), "counted": len(hits),
            "ttft_p50_ms": statistics.median(ttfts) * 1e3 if ttfts else None, "errors": errors,
            **{k.removeprefix("radixrelay_"): after.get(k, 0.0) - (0.0 if k.endswith("tokens") else before.get(k, 0.0))
               for k in PIN_COUNTERS}}


async def main_async(args: argparse.Namespace) -> int:
    from radixrelay.bench.provenance import device_slug, source_commit

    cpu = args.device == "cpu"
    work = Path(tempfile.mkdtemp(prefix="pinned_"))
    model = _model_dir(work / "model", args.device)
    tokenizer_arg = default_tokenizer()
    tokenizer = _server_tokenizer(tokenizer_arg)
    argv = ["--model", str(model), "--load-format", "dummy", "--tokenizer", tokenizer_arg, "--device", args.device,
            "--kv-cache-tokens", str(args.kv_cache_tokens), "--served-model-name", "m",
            "--pinned-kv-tokens", str(args.pinned_kv_tokens), *args.server_args.split()]
    if cpu:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        device = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
        slug = "cpu"
    else:
        import torch

        device = torch.cuda.get_device_name(0)
        slug = device_slug(device)
    system = words(np.random.default_rng(args.seed + 1), tokenizer, args.system_tokens)
    rows = []
    server = Server(argv, work / "server.log")
    try:
        async with httpx.AsyncClient() as http:
            await server.wait_ready(http, args.startup_timeout)
        for pinned in (True, False):
            rows.append(await run(args, server.base_url, system, pinned, tokenizer))
            print(rows[-1], flush=True)
    finally:
        server.stop()
    meta = {"device": device, "commit": source_commit(ROOT),
            "when": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "model": "a dummy Llama of 2 tiny layers" if cpu else "Llama-3-8B shapes, dummy bf16 weights",
            "command": "python -m benchmarks.serving.bench_pinned " + " ".join(args.argv)}
    out_dir = Path(args.out_dir or os.environ.get("OUT") or RESULTS / "serving")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"pinned_{slug}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    churned = args.churn * args.churn_tokens
    lines = [f"# A pinned system prompt under memory pressure ({device})", "",
             f"{meta['when']}; commit {meta['commit']}; {meta['model']}, {args.kv_cache_tokens} KV tokens, pins up to "
             f"{args.pinned_kv_tokens}. Command: `{meta['command']}`", "",
             f"{args.agents} agent requests over one system prompt of ~{args.system_tokens} tokens (max_tokens 1, one "
             f"at a time), {args.churn} unpinned requests of {args.churn_tokens} unique tokens before each after the "
             f"first ({churned} tokens: {churned / args.kv_cache_tokens:.1f}x the pool between two agent requests).", "",
             "| run | system prompt hit ratio | requests with >= 99% of it cached | agent TTFT p50 ms | pin hits | "
             "pin yields | pinned tokens at the end | errors |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = "-" if r["hit_ratio"] is None else f"{r['hit_ratio']:.3f}"
        ttft = "-" if r["ttft_p50_ms"] is None else f"{r['ttft_p50_ms']:.1f}"
        lines.append(f"| {r['run']} | {ratio} | {r['full_hits']} / {r['counted']} | {ttft} | {r['pin_hits_total']:.0f} | "
                     f"{r['pin_yields_total']:.0f} | {r['radix_pinned_tokens']:.0f} | {r['errors']} |")
    (out_dir / f"pinned_{slug}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def main() -> int:
    import sys

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--agents", type=int, default=None, help="agent requests (default: cpu 12, cuda 40)")
    p.add_argument("--system-tokens", type=int, default=6000)
    p.add_argument("--churn", type=int, default=None, help="unpinned requests between two agent requests "
                   "(default: cpu 3, cuda 8)")
    p.add_argument("--churn-tokens", type=int, default=None, help="(default: cpu 4000, cuda 8000)")
    p.add_argument("--kv-cache-tokens", type=int, default=None, help="(default: cpu 12288, cuda 49152)")
    p.add_argument("--pinned-kv-tokens", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--server-args", default="", help="more `radixrelay serve` options, one string")
    p.add_argument("--out-dir", default=None)
    args = p.parse_args()
    args.argv = sys.argv[1:]
    cpu = args.device == "cpu"
    args.agents = args.agents or (12 if cpu else 40)
    args.churn = args.churn if args.churn is not None else (3 if cpu else 8)
    args.churn_tokens = args.churn_tokens or (4000 if cpu else 8000)
    args.kv_cache_tokens = args.kv_cache_tokens or (12288 if cpu else 49152)
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    raise SystemExit(main())
