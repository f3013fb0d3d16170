"""A long document asked many questions, through the real server: the host path of cached prompts.

Per document length (tokens) and prompt form (``text``: the document as text; ``ids``: as token ids,
tokenized here with the server's tokenizer), on an emptied radix cache:

- ``cold``: the document sent once (max_tokens 1), the prefill of the whole of it;
- ``idle``: --repeats times the document + 5 new words, one at a time on one kept-alive connection,
  max_tokens 1, non-streaming (TTFT = latency): the cached-prompt TTFT of an idle server;
- ``burst B`` (each B of --bursts): B different questions over the cached document sent at once,
  max_tokens 1: the wall time of the burst and the latency p50;
- ``burst B x OUT`` (B = --stream-burst, OUT = --stream-out): B questions at once, streamed, OUT tokens
  out: TTFT p50 (first content chunk) and the mean time per output token after it.

Around each phase /metrics is scraped: model steps, the worker's and the scheduler's busy seconds, and
the server's per-stage host seconds of a request (``radixrelay_request_stage_seconds``) where it has
them. The client is not the project's: timed requests go over raw HTTP/1.1 connections opened before
the clock starts (``raw_http``; ``--client httpx`` sends them through one httpx client instead, whose
own event-loop work delays the sending of a burst), their bodies built before it too.

    python -m benchmarks.serving.bench_long_doc --device cpu                  # tiny dummy model, 742 / 30K
    python -m benchmarks.serving.bench_long_doc --device cuda                 # Llama-3-8B shapes, dummy bf16
    python -m benchmarks.serving.bench_long_doc --device cuda --lengths 2000,112000 --forms ids

On the CPU the model is a dummy Llama of 2 tiny layers with a 131K context, so that the host work is
most of what is timed; on CUDA it is Llama-3-8B's shapes with dummy bf16 weights and a 131K context.
Results: ``long_doc_<device>.md`` (and ``.json``) in --out-dir ($OUT if set, else
benchmarks/results/serving/).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks.common import LLAMA3_SHAPES, RESULTS, ROOT, Server, default_tokenizer, scrape
from benchmarks.serving.raw_http import Connection, HTTPStatusError, open_connections
from radixrelay.bench.words import WORDS

NEW_WORDS = 5
CONTEXT = 131072
_COUNTERS = ("radixrelay_steps_total", "radixrelay_worker_busy_seconds_total",
             "radixrelay_scheduler_busy_seconds_total",
             # how the steps ran: eager, on graphs, small extends as decode-graph rows, extends that read
             # a shared cached run once (prefill cascade) and the KV token reads that saved
             "radixrelay_eager_steps_total", "radixrelay_graph_replays_total", "radixrelay_extend_row_steps_total",
             "radixrelay_prefill_cascade_steps_total", "radixrelay_prefill_cascade_tokens_read_once_total")
_STAGE = re.compile(r'^radixrelay_request_stage_seconds_sum\{stage="(\w+)"\}\s+(\S+)$')


def _model_dir(path: Path, device: str) -> Path:
    """A config.json for dummy weights: 2 tiny layers (cpu) or Llama-3-8B's shapes (cuda), 131K context."""
    if device == "cpu":
        shapes = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
    else:
        hidden, mlp, heads, kv_heads, layers = LLAMA3_SHAPES["8b"]
        shapes = {"hidden_size": hidden, "intermediate_size": mlp, "num_hidden_layers": layers,
                  "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": 128}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, **shapes,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": CONTEXT,
        "tie_word_embeddings": False}, indent=1))
    return path


class Prompts:
    """The document of ``tokens`` tokens and its questions, as text or as token ids (BOS first, as the
    server's own encoding of a completion prompt)."""

    def __init__(self, tokenizer, tokens: int, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.tokenizer = tokenizer
        text = " ".join(self.rng.choice(WORDS, tokens))
        ids = tokenizer.encode(text, add_special_tokens=False)[: tokens - 1]
        self.doc_text = tokenizer.decode(ids, skip_special_tokens=False)
        self.bos = [tokenizer.bos_token_id] if tokenizer.add_bos_token and tokenizer.bos_token_id is not None else []

    def question(self) -> str:
        return " " + " ".join(self.rng.choice(WORDS, NEW_WORDS))

    def body(self, form: str, question: str, max_tokens: int, stream: bool = False) -> dict[str, Any]:
        text = self.doc_text + question
        prompt: Any = text if form == "text" else self.bos + self.tokenizer.encode(text, add_special_tokens=False)
        body = {"model": "doc", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        if stream:
            body.update(stream=True, stream_options={"include_usage": True}, ignore_eos=True)
        return body


class Errors:
    """Requests of a run that failed (a transport error or a non-200), by kind: counted, not fatal."""

    def __init__(self) -> None:
        self.kinds: dict[str, int] = {}

    def add(self, exc: Exception) -> None:
        kind = f"{type(exc).__name__}: {exc}"[:120]
        self.kinds[kind] = self.kinds.get(kind, 0) + 1


async def _post(http: httpx.AsyncClient, url: str, body: bytes,
                errors: Errors | None = None) -> tuple[float, dict[str, Any]]:
    start = time.perf_counter()
    try:
        reply = await http.post(url, content=body, headers={"content-type": "application/json"})
        reply.raise_for_status()
    except httpx.HTTPError as exc:
        if errors is None:
            raise
        errors.add(exc)
        return float("nan"), {}
    return time.perf_counter() - start, reply.json()


_RAW_ERRORS = (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, HTTPStatusError, ValueError)


class Sender:
    """How timed requests go out: over raw connections opened before the clock starts (one per
    request of a burst, one kept for the idle requests), or through the shared httpx client."""

    def __init__(self, kind: str, http: httpx.AsyncClient, base_url: str) -> None:
        self.kind, self.http, self.base_url = kind, http, base_url
        self.path = "/v1/completions"

    async def connections(self, count: int) -> list[Connection | None]:
        if self.kind == "httpx":
            return [None] * count
        return list(await open_connections(self.base_url, count))

    @staticmethod
    def close(connections: list[Connection | None]) -> None:
        for conn in connections:
            if conn is not None:
                conn.close()

    async def post(self, conn: Connection | None, body: bytes, errors: Errors) -> tuple[float, dict[str, Any]]:
        if conn is None:
            return await _post(self.http, self.base_url + self.path, body, errors)
        start = time.perf_counter()
        try:
            reply = await conn.post_json(self.path, body)
        except _RAW_ERRORS as exc:
            errors.add(exc)
            return float("nan"), {}
        return time.perf_counter() - start, reply

    async def stream(self, conn: Connection | None, body: bytes, errors: Errors) -> tuple[float, float, int]:
        """(TTFT, end, output tokens) of one streamed completion, seconds from its send; NaNs if it failed."""
        if conn is None:
            return await _stream(self.http, self.base_url + self.path, body, errors)
        start = time.perf_counter()
        ttft, tokens = None, 0
        try:
            async for line in conn.post_stream(self.path, body):
                ttft, tokens = _sse_line(line, start, ttft, tokens)
        except _RAW_ERRORS as exc:
            errors.add(exc)
            return float("nan"), float("nan"), 0
        return ttft or float("nan"), time.perf_counter() - start, tokens


def _sse_line(line: str, start: float, ttft: float | None, tokens: int) -> tuple[float | None, int]:
    """One line of a streamed completion: the TTFT once its first choice arrives, the usage's count."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return ttft, tokens
    chunk = json.loads(line[6:])
    if chunk.get("choices") and ttft is None:
        ttft = time.perf_counter() - start
    if chunk.get("usage"):
        tokens = chunk["usage"]["completion_tokens"]
    return ttft, tokens


async def _flush(http: httpx.AsyncClient, server: Server, timeout_s: float = 120.0) -> None:
    """Empty the radix cache, waiting while requests still run (409)."""
    deadline = time.monotonic() + timeout_s
    while True:
        reply = await http.post(f"{server.base_url}/flush_cache")
        if reply.status_code != 409 or time.monotonic() > deadline:
            reply.raise_for_status()
            return
        await asyncio.sleep(0.5)


async def _stream(http: httpx.AsyncClient, url: str, body: bytes, errors: Errors) -> tuple[float, float, int]:
    """(TTFT, end, output tokens) of one streamed completion, seconds from its send; NaNs if it failed."""
    start = time.perf_counter()
    ttft, tokens = None, 0
    try:
        async with http.stream("POST", url, content=body, headers={"content-type": "application/json"}) as reply:
            reply.raise_for_status()
            async for line in reply.aiter_lines():
                ttft, tokens = _sse_line(line, start, ttft, tokens)
    except httpx.HTTPError as exc:
        errors.add(exc)
        return float("nan"), float("nan"), 0
    return ttft or float("nan"), time.perf_counter() - start, tokens


def _median(values) -> float:
    values = [v for v in values if v == v]            # failed requests (NaN) left out
    return statistics.median(values) if values else float("nan")


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k.removeprefix("radixrelay_"): after.get(k, 0.0) - before.get(k, 0.0) for k in after}


async def _counters(http: httpx.AsyncClient, server: Server) -> dict[str, float]:
    """The step and busy counters, and each request stage's seconds (``stage_<name>``)."""
    values = await scrape(http, server.base_url)
    out = {k: values.get(k, 0.0) for k in _COUNTERS}
    text = (await http.get(f"{server.base_url}/metrics", timeout=30)).text
    out.update({f"stage_{m[1]}": float(m[2]) for line in text.splitlines() if (m := _STAGE.match(line))})
    return out


async def _phase(http: httpx.AsyncClient, server: Server, work) -> tuple[Any, dict[str, float]]:
    before = await _counters(http, server)
    result = await work
    return result, _delta(before, await _counters(http, server))


async def run_length(http: httpx.AsyncClient, server: Server, tokenizer, tokens: int, form: str,
                     args: argparse.Namespace, seed: int) -> dict[str, Any]:
    url = f"{server.base_url}/v1/completions"
    sender = Sender(args.client, http, server.base_url)
    prompts = Prompts(tokenizer, tokens, seed)
    enc = lambda body: json.dumps(body).encode()                          # noqa: E731
    await _flush(http, server)
    errors = Errors()
    row: dict[str, Any] = {"tokens": tokens, "form": form}
    (cold, first), _ = await _phase(http, server, _post(http, url, enc(prompts.body(form, prompts.question(), 1))))
    row["prompt_tokens"] = first["usage"]["prompt_tokens"]
    row["cold_s"] = cold
    # what the "cold" request found cached: /flush_cache empties the device's tree only, so a document the
    # host tier still holds (an earlier form's, on CUDA) is restored from host memory, not computed
    row["cold_cached"] = first["usage"].get("prompt_tokens_details", {}).get("cached_tokens")
    bodies = [enc(prompts.body(form, prompts.question(), 1)) for _ in range(args.repeats)]

    profiler = (Profiler(server.proc.pid, Path(args.out_dir_path) / f"profile_{tokens}_{form}.txt")
                if tokens in args.profile else None)

    async def idle() -> list[tuple[float, dict[str, Any]]]:
        conns = await sender.connections(1)
        try:
            return [await sender.post(conns[0], b, errors) for b in bodies]
        finally:
            sender.close(conns)

    replies, counters = await _phase(http, server, idle())
    row["idle_ttft_ms"] = [1e3 * lat for lat, _ in replies]
    row["idle_ttft_p50_ms"] = _median(row["idle_ttft_ms"])
    answered = [reply for _, reply in replies if reply]
    row["idle_cached"] = answered[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] if answered else None
    row["idle_per_request"] = {k: v / len(bodies) for k, v in counters.items()}
    row["bursts"] = []
    for size in args.bursts:
        bodies = [enc(prompts.body(form, prompts.question(), 1)) for _ in range(size)]
        conns = await sender.connections(size)

        async def burst() -> tuple[float, list[float]]:
            start = time.perf_counter()
            done = await asyncio.gather(*(sender.post(c, b, errors) for c, b in zip(conns, bodies)))
            return time.perf_counter() - start, [lat for lat, _ in done]

        (wall, lats), counters = await _phase(http, server, burst())
        sender.close(conns)
        row["bursts"].append({"size": size, "wall_s": wall, "latency_p50_s": _median(lats),
                              "per_request": {k: v / size for k, v in counters.items()}})
    if args.stream_burst:
        bodies = [enc(prompts.body(form, prompts.question(), args.stream_out, stream=True))
                  for _ in range(args.stream_burst)]
        conns = await sender.connections(args.stream_burst)

        sent_at: list[float] = []

        async def streamed() -> list[tuple[float, float, int]]:
            sent_at.append(time.monotonic())          # the scheduler's step log (RADIXRELAY_STEP_LOG) clock
            return await asyncio.gather(*(sender.stream(c, b, errors) for c, b in zip(conns, bodies)))

        done, counters = await _phase(http, server, streamed())
        sender.close(conns)
        tpot = [(end - ttft) / (n - 1) for ttft, end, n in done if n > 1]
        row["stream"] = {"size": args.stream_burst, "out": args.stream_out,
                         "ttft_p50_s": _median(t for t, _, _ in done),
                         "tpot_p50_ms": 1e3 * statistics.median(tpot) if tpot else None,
                         "sent_monotonic_s": sent_at[0], "ttfts_s": sorted(t for t, _, _ in done),
                         "per_request": {k: v / args.stream_burst for k, v in counters.items()}}
    if profiler is not None:
        profiler.stop()
    row["errors"] = errors.kinds
    return row


class Profiler:
    """py-spy (where installed) recording the server and its child processes while a phase runs: collapsed
    stacks (``--format raw``) in ``path``, for finding where a burst's host time goes."""

    def __init__(self, pid: int, path: Path) -> None:
        import shutil
        import subprocess

        import sys

        exe = shutil.which("py-spy") or shutil.which("py-spy", path=f"{sys.prefix}/bin:/tmp/site/bin")
        self.proc = None
        if exe is None:
            print("  (no py-spy: not profiled)", flush=True)
            return
        self.proc = subprocess.Popen([exe, "record", "--pid", str(pid), "--subprocesses", "--rate", "200",
                                      "--format", "raw", "--nonblocking", "-o", str(path)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)                       # attached before the phase starts

    def stop(self) -> None:
        import signal

        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(60)


def _line(row: dict[str, Any]) -> str:
    bursts = "; ".join(f"{b['size']} at once: wall {b['wall_s']:.3f} s, p50 {b['latency_p50_s']:.3f} s"
                       for b in row["bursts"])
    stream = row.get("stream")
    streamed = (f"; {stream['size']} x {stream['out']} out: TTFT p50 {stream['ttft_p50_s']:.3f} s"
                if stream else "")
    failed = f"; failed: {row['errors']}" if row.get("errors") else ""
    return (f"{row['prompt_tokens']:>7d} tokens {row['form']:4s}  cold {row['cold_s']:.2f} s{_cold_note(row)}  idle TTFT p50 "
            f"{row['idle_ttft_p50_ms']:.1f} ms (cached {row['idle_cached']})  {bursts}{streamed}{failed}")


def _cold_note(row: dict[str, Any]) -> str:
    """`` (N cached)`` when the cold request found part of its prompt cached (a host-tier restore)."""
    cached = row.get("cold_cached")
    return f" ({cached} cached)" if cached else ""


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [f"# A long document asked many questions ({meta['device']})", "",
             f"{meta['when']}; commit {meta['commit']}; {meta['model']}. Command: `{meta['command']}`", "",
             f"Completions through the real server (client: {meta.get('client', 'httpx')}); idle: one at a time, "
             "max_tokens 1 (TTFT = latency); "
             "bursts: at once, max_tokens 1; streamed: at once, TTFT of the first chunk.", "",
             "| prompt tokens | form | cold prefill s | idle TTFT p50 ms | bursts: wall s / latency p50 s | "
             "streamed burst: TTFT p50 s / TPOT ms | per idle request: steps, busy ms, stage ms |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        bursts = "<br>".join(f"{b['size']}: {b['wall_s']:.3f} / {b['latency_p50_s']:.3f}" for b in r["bursts"])
        s = r.get("stream")
        streamed = f"{s['size']} x {s['out']}: {s['ttft_p50_s']:.3f} / {s['tpot_p50_ms'] or 0:.1f}" if s else ""
        per = r["idle_per_request"]
        stages = ", ".join([f"steps {per['steps_total']:.1f}", f"worker {1e3 * per['worker_busy_seconds_total']:.1f}",
                            f"scheduler {1e3 * per['scheduler_busy_seconds_total']:.2f}"]
                           + [f"{k[6:]} {1e3 * v:.2f}" for k, v in per.items() if k.startswith("stage_")])
        lines.append(f"| {r['prompt_tokens']} | {r['form']} | {r['cold_s']:.2f}{_cold_note(r)} | {r['idle_ttft_p50_ms']:.1f} | "
                     f"{bursts} | {streamed} | {stages} |")
    failures = [f"- {r['prompt_tokens']} tokens {r['form']}: {r['errors']}" for r in rows if r.get("errors")]
    if failures:
        lines += ["", "Requests that failed (left out of the medians):", "", *failures]
    lines += ["", "Ratios (longest against shortest, same form):", ""]
    for form in sorted({r["form"] for r in rows}):
        same = sorted((r for r in rows if r["form"] == form), key=lambda r: r["tokens"])
        if len(same) < 2:
            continue
        lo, hi = same[0], same[-1]
        parts = [f"idle TTFT {hi['idle_ttft_p50_ms'] / lo['idle_ttft_p50_ms']:.2f}x"]
        for a, b in zip(lo["bursts"], hi["bursts"]):
            parts.append(f"{a['size']} at once (wall) {b['wall_s'] / a['wall_s']:.2f}x")
        lines.append(f"- {form}: {hi['prompt_tokens']} vs {lo['prompt_tokens']} tokens: " + ", ".join(parts))
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--lengths", default=None, help="document lengths in tokens (default: cpu 742,30000; "
                                                   "cuda 2000,7000,31000,61000,112000)")
    p.add_argument("--forms", default="text,ids")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--bursts", default="32", help="burst sizes, max_tokens 1")
    p.add_argument("--stream-burst", type=int, default=None, help="(default: cpu 0, cuda 128)")
    p.add_argument("--stream-out", type=int, default=64)
    p.add_argument("--kv-cache-tokens", type=int, default=None, help="(default: cpu 65536, cuda 262144)")
    p.add_argument("--client", choices=("raw", "httpx"), default="raw",
                   help="timed requests over raw connections opened beforehand, or through one httpx client")
    p.add_argument("--server-args", default="", help="more `radixrelay serve` options, one string")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--profile", default="", help="document lengths whose idle requests, bursts and streamed "
                                                 "burst py-spy records (the server and its children), into --out-dir")
    return p


async def main_async(args: argparse.Namespace) -> int:
    from radixrelay.bench.provenance import device_slug, source_commit

    cpu = args.device == "cpu"
    lengths = [int(x) for x in (args.lengths or ("742,30000" if cpu else "2000,7000,31000,61000,112000")).split(",")]
    args.bursts = [int(x) for x in args.bursts.split(",") if x]
    if args.stream_burst is None:
        args.stream_burst = 0 if cpu else 128
    kv_tokens = args.kv_cache_tokens or (65536 if cpu else 262144)
    work = Path(tempfile.mkdtemp(prefix="long_doc_"))
    model = _model_dir(work / "model", args.device)
    tokenizer_arg = default_tokenizer()
    argv = ["--model", str(model), "--load-format", "dummy", "--tokenizer", tokenizer_arg, "--device", args.device,
            "--kv-cache-tokens", str(kv_tokens), "--served-model-name", "doc", "--max-running-requests", "256",
            *args.server_args.split()]
    if cpu:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    tokenizer = _server_tokenizer(tokenizer_arg)
    out_dir = Path(args.out_dir or os.environ.get("OUT") or RESULTS / "serving")
    out_dir.mkdir(parents=True, exist_ok=True)
    args.out_dir_path = out_dir
    args.profile = {int(x) for x in args.profile.split(",") if x}
    if cpu:
        device = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
        slug = "cpu"
    else:
        import torch

        device = torch.cuda.get_device_name(0)
        slug = device_slug(device)
    meta = {"device": device, "commit": source_commit(ROOT),
            "when": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "model": ("a dummy Llama of 2 tiny layers" if cpu else "Llama-3-8B shapes, dummy bf16 weights")
                     + f", 131K context, {kv_tokens} KV tokens, the default model's tokenizer",
            "command": "python -m benchmarks.serving.bench_long_doc " + " ".join(_argv_given()),
            "client": ("raw HTTP/1.1 connections opened before the clock starts" if args.client == "raw"
                       else "one httpx client")}
    server = Server(argv, work / "server.log")
    rows: list[dict[str, Any]] = []
    # idle connections dropped before the server's keep-alive (uvicorn's 5 s, httpx's default too) closes them:
    # a request sent on a connection the server is closing that moment fails with a ReadError
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024, keepalive_expiry=3.0)
    try:
        async with httpx.AsyncClient(timeout=900, limits=limits) as http:
            await server.wait_ready(http, 900)
            for k, tokens in enumerate(lengths):
                for form in args.forms.split(","):
                    try:
                        row = await run_length(http, server, tokenizer, tokens, form, args, seed=k)
                    except (httpx.HTTPError, ValueError) as exc:
                        print(f"{tokens} tokens {form}: failed: {type(exc).__name__}: {exc}", flush=True)
                        if server.proc.poll() is not None:
                            raise RuntimeError(f"the server exited: {server.log_tail()}") from None
                        continue
                    rows.append(row)
                    print(_line(row), flush=True)
    finally:
        server.stop()
        if args.out_dir or os.environ.get("OUT"):          # a remote run's folder: the server's log comes back too
            (out_dir / f"long_doc_{slug}_server.log").write_text(server.log_path.read_text(errors="replace")[-200_000:])
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"long_doc_{slug}.md").write_text(markdown(meta, rows))
    (out_dir / f"long_doc_{slug}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(markdown(meta, rows))
    return 0


def _server_tokenizer(arg: str):
    """The server's tokenizer, to build prompts here (its encode, decode and BOS)."""
    from radixrelay.model.model_registry import resolve_model_path
    from radixrelay.text.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model_path(arg))


def _argv_given() -> list[str]:
    import sys

    return sys.argv[1:]


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(main_async(parser().parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
