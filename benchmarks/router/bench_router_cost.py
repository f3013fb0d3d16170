"""What the router adds to a request: latency through ``radixrelay router`` against the same replica
directly, and routing decisions per second on one core.

The replicas here are stand-ins that answer at once (``/health``; a fixed chat completion with
``usage``), so that what is timed is the router alone: parsing, the chat template and tokenization of a
long prompt, the index lookup, the proxying. Requests are chat completions of the ``multi-tenant``
workload (tenants' long contexts, Zipf popularity), sent at a Poisson rate, one connection each as a
client pool would; the same requests go directly to a replica, then through the router, in each of
``--rounds`` rounds.

    python -m benchmarks.router.bench_router_cost [--context-len 6000] [--rate 100] [--requests 600]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import Response

from benchmarks.common import RESULTS
from radixrelay.bench.provenance import source_commit
from radixrelay.bench.workloads import MultiTenant

ANSWER = json.dumps({
    "id": "chatcmpl-0", "object": "chat.completion", "created": 0, "model": "stand-in",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2,
              "prompt_tokens_details": {"cached_tokens": 0}}}).encode()


def stand_in_app() -> FastAPI:
    """A replica that answers at once."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> Response:
        return Response(b"{}", media_type="application/json")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        await request.body()
        return Response(ANSWER, media_type="application/json")

    return app


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait(url: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready")


async def _send(url: str, bodies: list[bytes], rate: float, seed: int) -> list[float]:
    """Latency (s) of each body POSTed at Poisson times of ``rate`` per second."""
    gaps = np.random.default_rng(seed).exponential(1 / rate, size=len(bodies))
    out: list[float] = []
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=None)) as client:
        async def one(body: bytes) -> None:
            start = time.perf_counter()
            resp = await client.post(f"{url}/v1/chat/completions", content=body,
                                     headers={"content-type": "application/json"})
            resp.raise_for_status()
            out.append(time.perf_counter() - start)

        tasks = []
        for body, gap in zip(bodies, gaps):
            tasks.append(asyncio.create_task(one(body)))
            await asyncio.sleep(gap)
        await asyncio.gather(*tasks)
    return out


def decisions_per_second(bodies: list[dict], seconds: float = 3.0) -> tuple[float, float]:
    """(decisions per second with the prompt's keys computed, per second of the index lookup alone), in
    this process, one core: a router over 4 replicas whose index holds every tenant."""
    from radixrelay.model.model_registry import resolve_model_path
    from radixrelay.router.router_app import Router, RouterConfig
    from radixrelay.router.prompt import PromptKeys
    from radixrelay.text.chat_template import ChatTemplate
    from radixrelay.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_path("default"))
    router = Router(RouterConfig(tuple(f"http://127.0.0.1:{30001 + i}" for i in range(4))),
                    PromptKeys(tokenizer, ChatTemplate.for_tokenizer(tokenizer)))
    for i, replica in enumerate(router.pool.replicas):
        replica.healthy = True
    keys = [router.prompt_keys.keys("chat", b) for b in bodies]
    for i, k in enumerate(keys):
        router.index.record(router.pool.replicas[i % 4].url, k)
    rates = []
    for with_keys in (True, False):
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            body = bodies[n % len(bodies)]
            router.pick(router.prompt_keys.keys("chat", body) if with_keys else keys[n % len(keys)])
            n += 1
        rates.append(n / (time.perf_counter() - start))
    return rates[0], rates[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context-len", type=int, default=6000, help="tokens of each tenant's context")
    ap.add_argument("--tenants", type=int, default=20)
    ap.add_argument("--rate", type=float, default=100.0, help="requests per second")
    ap.add_argument("--requests", type=int, default=600, help="per side and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out-dir", default=str(RESULTS / "router"))
    args = ap.parse_args()

    workload = MultiTenant(tenants=args.tenants, context_len=args.context_len, output_len=1)
    sessions = workload.generate(args.requests, np.random.default_rng(0))
    bodies = [{"model": "stand-in", "max_tokens": 1,
               "messages": [{"role": "system", "content": s.system}, {"role": "user", "content": s.turns[0].user}]}
              for s in sessions]
    raw = [json.dumps(b).encode() for b in bodies]
    procs = []
    try:
        replicas = []
        for _ in range(2):
            port = _free_port()
            procs.append(subprocess.Popen([sys.executable, "-c", "import uvicorn, benchmarks.router.bench_router_cost "
                                           f"as b; uvicorn.run(b.stand_in_app(), port={port}, log_level='warning')"]))
            replicas.append(f"http://127.0.0.1:{port}")
        port = _free_port()
        router_url = f"http://127.0.0.1:{port}"
        procs.append(subprocess.Popen([sys.executable, "-m", "radixrelay.cli", "router", "--port", str(port),
                                       "--log-level", "warning", *[a for r in replicas for a in ("--replica", r)]]))
        for url in (*replicas, router_url):
            _wait(url)
        asyncio.run(_send(router_url, raw[:50], args.rate, 9))          # warm-up: connections, encode cache
        asyncio.run(_send(replicas[0], raw[:50], args.rate, 9))
        direct, routed = [], []
        for r in range(args.rounds):
            direct += asyncio.run(_send(replicas[0], raw, args.rate, r))
            routed += asyncio.run(_send(router_url, raw, args.rate, r))
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
    with_keys, lookup = decisions_per_second(bodies)
    ms = lambda xs, q: 1e3 * float(np.quantile(xs, q))  # noqa: E731

    lines = [f"# Router cost ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)", "",
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {source_commit(RESULTS.parent.parent)}. "
             f"Command: `python -m benchmarks.router.bench_router_cost {' '.join(sys.argv[1:])}`. Replicas: "
             f"stand-ins that answer at once; requests: chat completions of the multi-tenant workload "
             f"({args.tenants} tenants, {args.context_len}-token contexts), {args.rate:g} req/s Poisson, "
             f"{args.requests} per side and round, {args.rounds} rounds, each direct then routed.", "",
             "| path | latency p50 ms | p90 ms | p99 ms |", "|---|---|---|---|",
             f"| direct to a replica | {ms(direct, .5):.2f} | {ms(direct, .9):.2f} | {ms(direct, .99):.2f} |",
             f"| through the router | {ms(routed, .5):.2f} | {ms(routed, .9):.2f} | {ms(routed, .99):.2f} |",
             f"| **added by the router** | **{ms(routed, .5) - ms(direct, .5):.2f}** | "
             f"{ms(routed, .9) - ms(direct, .9):.2f} | {ms(routed, .99) - ms(direct, .99):.2f} |", "",
             f"Routing decisions per second on one core (this process, 4 replicas): {with_keys:,.0f} with the "
             f"prompt's chat template, tokenization and keys; {lookup:,.0f} for the index lookup and choice alone."]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "router_cost_cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
