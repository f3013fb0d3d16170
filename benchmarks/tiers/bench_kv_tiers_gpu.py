"""KV tiers end to end on a CUDA machine: the real server (Llama-3-8B shapes, dummy weights) under
multi-turn chats whose histories outgrow the device KV cache, with tiers off (recompute) vs host
memory (scheduler-aware or LRU eviction) vs a small host tier over disk, and (config ``roomy``) a device pool
large enough for every history: the floor a tier can at best match under the same traffic.

    bash benchmarks/gpu_env.sh && python -m benchmarks.tiers.bench_kv_tiers_gpu --configs off,host --out-dir DIR

Per config:
1. a load probe: for each of ``--probe-prompts`` prompts of ``--probe-words`` words, the prompt once
   (cached), then TTFT of the prompt + 5 new words with its history on the device, then, after
   /flush_cache (the device tree is dropped; the tiers keep their pages), TTFT of the prompt + 5 other
   words: the history comes from host memory (tiers on) or is recomputed (off);
2. ``bench_serving.py --workload multi-turn`` traffic (``MultiTurn`` with ``history_len``): sessions
   arrive by a Poisson process, several turns each with think time; the device pool is capped
   (``--kv-cache-tokens``) below the sessions' total history, as on a busy server.
Reports TTFT p50/p99 of first and later turns and of later turns with >= 4K-token history, the
history hit rate, and the tier counters' deltas (/metrics). Writes kv_tiers_<device>_<configs>.json (the
summary page, kv_tiers_<device>.md in benchmarks/results/tiers/, is written by hand from them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks.common import RESULTS, Server, default_tokenizer, llama3_8b_dir, scrape
from radixrelay.bench.arrivals import arrival_times
from radixrelay.bench.http_client import BenchClient, ClientConfig
from radixrelay.bench.summary import SLO, summarize
from radixrelay.bench.provenance import device_slug
from radixrelay.bench.runner import run_sessions, token_counter
from radixrelay.bench.workloads import MultiTurn, words

CONFIGS = {
    "off": ["--host-kv-gib", "0"],
    "host": ["--host-kv-gib", "48", "--kv-tier-policy", "scheduler"],
    "host-lru": ["--host-kv-gib", "48", "--kv-tier-policy", "lru"],
    "disk": ["--host-kv-gib", "{small_host}", "--disk-kv-gib", "40", "--disk-kv-path", "{disk}"],
    # the floor: a device pool that holds every session's history, so every later turn is a device hit
    # (what a tier could at best match under the same traffic); the later flag overrides the capped pool
    "roomy": ["--host-kv-gib", "0", "--kv-cache-tokens", "{roomy}"],
    # the same pool with the host tier on: every later turn still a device hit, so what the saves cost alone
    "roomy-host": ["--host-kv-gib", "48", "--kv-tier-policy", "scheduler", "--kv-cache-tokens", "{roomy}"],
}


async def ttft(client: BenchClient, text: str) -> tuple[float, int | None, int | None]:
    reply = await client.send([{"role": "user", "content": text}], 1)
    if not reply.ok:
        raise RuntimeError(f"probe request failed: {reply.error}")
    return reply.latency * 1e3, reply.prompt_tokens, reply.cached_tokens


async def flush(http: httpx.AsyncClient, server: Server) -> None:
    for _ in range(100):
        if (await http.post(f"{server.base_url}/flush_cache", timeout=30)).status_code == 200:
            return
        await asyncio.sleep(0.2)
    raise RuntimeError("flush_cache kept failing")


async def load_probe(server: Server, client: BenchClient, args, rng) -> dict[str, Any]:
    device, lower, cached_dev, cached_low = [], [], [], []
    async with httpx.AsyncClient() as http:
        for _ in range(args.probe_prompts):
            base = words(rng, args.probe_words)
            await ttft(client, base)
            t, _, c = await ttft(client, f"{base} {words(rng, 5)}")
            device.append(t)
            cached_dev.append(c)
            await asyncio.sleep(0.5)            # saves acknowledged: the flush can drop the pages
            await flush(http, server)
            t, prompt, c = await ttft(client, f"{base} {words(rng, 5)}")
            lower.append(t)
            cached_low.append(c)
    return {"prompt_tokens": prompt, "ttft_device_ms": device, "ttft_after_flush_ms": lower,
            "cached_device": cached_dev, "cached_after_flush": cached_low,
            "p50_device_ms": float(np.median(device)), "p50_after_flush_ms": float(np.median(lower))}


async def run_config(name: str, argv: list[str], args, model_argv: list[str], out: Path) -> dict[str, Any]:
    server = Server([*model_argv, *argv], out / f"server_{name}.log")
    result: dict[str, Any] = {"config": name, "flags": argv}
    try:
        async with httpx.AsyncClient() as http:
            start = time.perf_counter()
            await server.wait_ready(http, 900)
            result["startup_s"] = time.perf_counter() - start
        cfg = ClientConfig(base_url=server.base_url, model=args.served_model, ignore_eos=True, timeout=600,
                           endpoint="completions", stream=False)
        counter = token_counter(None)
        async with BenchClient(cfg) as client:
            warm = np.random.default_rng(1000)
            for _ in range(2):                   # untimed: compile paths of long prefills and loads
                await load_probe(server, client, argparse.Namespace(probe_prompts=1, probe_words=args.probe_words),
                                 warm)
            result["probe"] = await load_probe(server, client, args, np.random.default_rng(7))
            print(f"[{name}] probe: device {result['probe']['p50_device_ms']:.1f} ms, after flush "
                  f"{result['probe']['p50_after_flush_ms']:.1f} ms", flush=True)
        workload = MultiTurn(sessions=args.sessions, turns=args.turns, system_len=64, turn_len=args.turn_len,
                             output_len=args.output_len, think_time=args.think_time, history_len=args.history_len)
        sessions = workload.generate(args.sessions * args.turns, np.random.default_rng(11))
        arrivals = arrival_times(len(sessions), args.session_rate, np.random.default_rng(12))
        chat = ClientConfig(base_url=server.base_url, model=args.served_model, ignore_eos=True, timeout=600)
        async with httpx.AsyncClient() as http, BenchClient(chat) as client:
            before = await scrape(http, server.base_url)
            run = await run_sessions(client, sessions, arrivals, max_concurrency=None, counter=counter,
                                     desc=f"multi-turn {name}")
            after = await scrape(http, server.base_url)
        summary = summarize(run.records, run.duration_s, SLO())
        result["multi_turn"] = summary.get("multi_turn")
        result["summary"] = {k: summary[k] for k in ("completed", "failed", "duration_s", "ttft_ms",
                                                     "output_token_throughput", "cache_hit_ratio")}
        result["counters"] = {k: after[k] - before.get(k, 0.0) for k in after
                              if "kv_tier" in k or "cache_hit" in k or "prompt_tokens" in k}
        mt = result["multi_turn"] or {}
        print(f"[{name}] later-turn TTFT p50 {mt.get('ttft_later_ms', {}).get('p50')} ms, history hit "
              f"{mt.get('history_hit_rate')}", flush=True)
    finally:
        server.stop()
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="off,host,host-lru,disk")
    p.add_argument("--out-dir", type=Path, default=RESULTS / "tiers")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-cache-tokens", type=int, default=65536)
    p.add_argument("--small-host-gib", type=float, default=2.0)
    p.add_argument("--roomy-kv-tokens", type=int, default=400_000,
                   help="config roomy: device KV tokens (every history fits)")
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--history-len", type=int, default=4000)
    p.add_argument("--turn-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--think-time", type=float, default=10.0)
    p.add_argument("--session-rate", type=float, default=4.0)
    p.add_argument("--probe-prompts", type=int, default=5)
    p.add_argument("--probe-words", type=int, default=4000)
    p.add_argument("--smoke", action="store_true", help="CPU check of the script: default model, tiny sizes")
    args = p.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="kv-tiers-"))
    if args.smoke:
        args.sessions, args.turns, args.history_len, args.probe_prompts, args.probe_words = 3, 2, 100, 1, 100
        args.think_time, args.output_len, args.kv_cache_tokens, args.small_host_gib = 0.2, 4, 16 * 24, 0.01
        args.roomy_kv_tokens = 16 * 64
        CONFIGS["host"][1] = CONFIGS["host-lru"][1] = "0.2"
        model_argv = ["--model", "default", "--kv-cache-tokens", str(args.kv_cache_tokens)]
        args.served_model = "default"
    else:
        model_dir = llama3_8b_dir(tmp / "llama3-8b", args.layers, 49152)
        model_argv = ["--model", str(model_dir), "--load-format", "dummy", "--tokenizer", default_tokenizer(),
                      "--kv-cache-tokens", str(args.kv_cache_tokens)]
        args.served_model = str(model_dir)
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    results = []
    for name in args.configs.split(","):
        flags = [f.format(small_host=args.small_host_gib, disk=tmp / "disk", roomy=args.roomy_kv_tokens)
                 for f in CONFIGS[name]]
        results.append(asyncio.run(run_config(name, flags, args, model_argv, args.out_dir)))
        path = args.out_dir / f"kv_tiers_{device_slug(device)}_{'_'.join(args.configs.split(','))}.json"
        path.write_text(json.dumps({"device": device, "args": vars(args) | {"out_dir": str(args.out_dir)},
                                    "model_argv": model_argv, "results": results}, indent=1, default=str))
        print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
