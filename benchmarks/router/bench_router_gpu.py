"""Replicas behind the router on a multi-GPU host: precise routing (the replicas' KV events in Redis)
against approximate and round-robin, under many tenants with long contexts.

One ``radixrelay serve`` per GPU (Llama-3-8B shapes, dummy bf16 weights, ``--kv-cache-tokens`` per
replica, ``--kv-events`` into a local ``redis-server``), then per routing mode: a fresh router, every
replica's cache flushed, one untimed request per tenant (each tenant's context computed once
somewhere), then the ``multi-tenant`` workload (Zipf-popular tenants, ``--context-len`` tokens of context
each, 64-token questions, 128 output tokens, EOS ignored) at each of ``--rates`` (Poisson), through the
router. The working set (tenants x context) is sized against the pools: by default about twice one
replica's pool and below all replicas' total, so round-robin thrashes every pool and a router that keeps
each tenant on one replica fits them all. Reported per mode and rate: output tok/s, the cache hit ratio
the client sees (cached prompt tokens over prompt tokens), TTFT p50 / p90.

    python -m benchmarks.router.bench_router_gpu [--replicas 2] [--tenants 60] [--context-len 6000]
        [--kv-cache-tokens 220000] [--zipf 1.1] [--rates 8,200] [--requests 200] [--out-dir DIR]

redis-server: the one on PATH, else ``.whl/redis`` (``bash scripts/fetch_redis.sh .whl``: Debian's package
unpacked, carried to a GPU machine without network), else ``.venv/redis``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from benchmarks.common import RESULTS, ROOT, Server, default_tokenizer, llama3_8b_dir
from radixrelay.bench.arrivals import arrival_times
from radixrelay.bench.http_client import ClientConfig
from radixrelay.bench.summary import SLO, summarize
from radixrelay.bench.provenance import device_slug, source_commit
from radixrelay.bench.runner import run_sessions_parallel, token_counter
from radixrelay.bench.workloads import MultiTenant

MODES = ("round-robin", "approximate", "precise")


def redis_server(tmp: Path) -> tuple[subprocess.Popen, str]:
    import shutil

    import redis

    binary, env = shutil.which("redis-server"), dict(os.environ)
    if binary is None:
        for base in (ROOT / ".whl" / "redis", ROOT / ".venv" / "redis"):
            if (base / "usr/bin/redis-server").exists():
                binary = str(base / "usr/bin/redis-server")
                env["LD_LIBRARY_PATH"] = f"{base}/usr/lib/x86_64-linux-gnu:{env.get('LD_LIBRARY_PATH', '')}"
                break
    if binary is None:
        raise RuntimeError("no redis-server: bash scripts/fetch_redis.sh .whl")
    port = 6390
    proc = subprocess.Popen([binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly",
                             "no", "--dir", str(tmp)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            client.ping()
            return proc, f"redis://127.0.0.1:{port}/0"
        except redis.ConnectionError:
            time.sleep(0.1)
    raise RuntimeError("redis-server did not start")


class Router:
    def __init__(self, replicas: list[str], mode: str, store: str, log: Path) -> None:
        self.port = 30980
        self.base_url = f"http://127.0.0.1:{self.port}"
        args = [a for url in replicas for a in ("--replica", url)]
        self.log = open(log, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "radixrelay.cli", "router", *args, "--mode", mode,
                                      "--store", store, "--tokenizer", default_tokenizer(), "--port",
                                      str(self.port), "--log-level", "warning"], stdout=self.log,
                                     stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                         p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)})
        for _ in range(300):
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited: {log.read_text()[-1500:]}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError("router not ready")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


async def run_mode(mode: str, replicas: list[Server], store: str, args, workload: MultiTenant, out: Path,
                   counter) -> list[dict]:
    router = Router([r.base_url for r in replicas], mode, store, out / f"router_{mode}.log")
    rows = []
    try:
        async with httpx.AsyncClient() as http:
            for r in replicas:
                await http.post(f"{r.base_url}/flush_cache", timeout=30)
        config = ClientConfig(base_url=router.base_url, model=args.served_model, ignore_eos=True, timeout=600)
        # one draw for everything: the tenants' contexts are the same text in the warm-up and every run
        every = workload.generate(args.requests * len(args.rates), np.random.default_rng([args.seed, 0]))
        firsts = list({s.label: s for s in every}.values())          # one request per tenant asked
        await run_sessions_parallel(config, firsts, np.zeros(len(firsts)), processes=2, counter=counter,
                                    desc=f"{mode} warm-up")
        for k, rate in enumerate(args.rates):
            sessions = every[k * args.requests:(k + 1) * args.requests]
            arrivals = arrival_times(len(sessions), rate, np.random.default_rng([args.seed, 2, k]))
            result = await run_sessions_parallel(config, sessions, arrivals, processes=args.client_processes,
                                                 counter=counter, desc=f"{mode} @ {rate:g}")
            s = summarize(result.records, result.duration_s, SLO())
            row = {"mode": mode, "rate": rate, "completed": s["completed"], "failed": s["failed"],
                   "out_tok_s": s["output_token_throughput"], "cache_hit": s["cache_hit_ratio"],
                   "ttft_p50": s["ttft_ms"]["p50"], "ttft_p90": s["ttft_ms"]["p90"], "req_s": s["request_throughput"]}
            print(row, flush=True)
            rows.append(row)
    finally:
        router.stop()
    return rows


def write(rows: list[dict], args, n: int) -> None:
    import torch

    name = torch.cuda.get_device_name(0) if args.device != "cpu" else "CPU"
    lines = [f"# Replicas behind the router ({n} x {name})", "",
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; commit {source_commit(ROOT)}. "
             f"Command: `{shlex.join(['python', '-m', 'benchmarks.router.bench_router_gpu', *sys.argv[1:]])}`", "",
             f"{n} replicas (one per GPU), Llama-3-8B shapes ({args.layers} layers, dummy bf16 weights), "
             f"{args.kv_cache_tokens:,} KV tokens each, no host tier, KV events into a local redis-server. "
             f"multi-tenant: {args.tenants} tenants x {args.context_len} context tokens (working set "
             f"{args.tenants * args.context_len:,} tokens), Zipf popularity {args.zipf:g}, 64-token questions, 128 output "
             f"tokens; per mode a fresh router, caches flushed, one untimed request per tenant, then "
             f"{args.requests} requests per Poisson rate.", "",
             "| mode | rate | done/failed | req/s | out tok/s | cache hit | TTFT p50 ms | TTFT p90 ms |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        hit = "n/a" if r["cache_hit"] is None else f"{100 * r['cache_hit']:.0f}%"
        ttft = " | ".join("n/a" if r[k] is None else f"{r[k]:.0f}" for k in ("ttft_p50", "ttft_p90"))
        lines.append(f"| {r['mode']} | {r['rate']:g} | {r['completed']}/{r['failed']} | {r['req_s']:.2f} "
                     f"| {r['out_tok_s']:,.0f} | {hit} | {ttft} |")
    path = args.out_dir / f"router_{device_slug(name)}.md"
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=None, help="(default: every visible GPU)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--tenants", type=int, default=60)
    p.add_argument("--context-len", type=int, default=6000)
    p.add_argument("--zipf", type=float, default=1.1,
                   help="tenant popularity exponent (default: %(default)s; lower: flatter, more of the working set hot)")
    p.add_argument("--kv-cache-tokens", type=int, default=220_000, help="per replica")
    p.add_argument("--rates", type=lambda t: [float(x) for x in t.split(",")], default=[8.0, 200.0])
    p.add_argument("--requests", type=int, default=200, help="per rate")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--client-processes", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the script on the default model")
    p.add_argument("--out-dir", type=Path, default=Path(os.environ.get("OUT") or RESULTS / "router"))
    args = p.parse_args(argv)
    import torch

    n = args.replicas or torch.cuda.device_count()
    cpu = args.device == "cpu"
    workload = MultiTenant(tenants=args.tenants, context_len=args.context_len, zipf=args.zipf)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    counter = token_counter(None)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="radixrelay-router-") as tmp:
        redis_proc, store = redis_server(Path(tmp))
        model_args = (["--model", "default", "--device", "cpu"] if cpu else
                      ["--model", str(llama3_8b_dir(Path(tmp) / "llama3-8b", args.layers, 49152)), "--load-format",
                       "dummy", "--tokenizer", default_tokenizer(), "--device", "cuda", "--dtype", "bfloat16"])
        args.served_model = model_args[1]                 # the name the replicas serve (their --model)
        servers = []
        try:
            for i in range(n):
                if not cpu:
                    os.environ["CUDA_VISIBLE_DEVICES"] = str(i)
                servers.append(Server([*model_args, "--kv-cache-tokens", str(args.kv_cache_tokens),
                                       "--kv-events", store, "--host-kv-gib", "0"], args.out_dir / f"replica{i}.log"))
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)

            async def go() -> None:
                async with httpx.AsyncClient() as http:
                    for s in servers:
                        await s.wait_ready(http, 600)
                for mode in args.modes.split(","):
                    rows.extend(await run_mode(mode, servers, store, args, workload, args.out_dir, counter))
                    write(rows, args, n)
            asyncio.run(go())
        finally:
            for s in servers:
                s.stop()
            redis_proc.terminate()
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
