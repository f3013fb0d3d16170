"""Host work on the path of a cached-prompt request, per stage, by prompt length (CPU is enough).

The TTFT floor (a request whose prompt is cached but for a few tokens, on an idle server) is one
model step plus the host work around it: HTTP body, chat template, tokenizer, IPC to the
scheduler, radix match and admission, the plan to the worker (which gets only the uncached tokens),
the output back, detokenization and the response. This script measures that host work two ways:

- ``stages``: each stage called in this process on the prompt the TTFT probe sends (a text of N
  words sent once, then the same text + 5 new words), median milliseconds over --repeats. The
  scheduler stages run a real ``Scheduler`` whose radix tree holds the first prompt.
  ``tokenize (whole text)`` is one ``tokenizers`` encode of the whole text (what the server did
  before chunked encoding); ``tokenize`` is the server's encode of the extended prompt after the
  first one was encoded.
- ``e2e``: the real server (``radixrelay serve``) on a dummy model of 2 tiny layers with a 32K
  context (so that 20K-token prompts run on a CPU), the TTFT probe of bench_serving_gpu.py
  (non-streaming, max_tokens 1: TTFT = latency) on the chat and completions endpoints, median of
  --repeats, plus the worker's and the scheduler's busy milliseconds per step from /metrics. The
  model step itself (a CPU forward over the whole cached context, one torch thread unless
  OMP_NUM_THREADS says otherwise) is part of the latency; the rest is host work. With
  --profile-dir the scheduler and worker run under cProfile (RADIXRELAY_PROFILE_DIR) and write
  their profiles there when the server stops.

    .venv/bin/python -m benchmarks.serving.bench_ttft_host                       # both, 2K / 8K / 20K words
    .venv/bin/python -m benchmarks.serving.bench_ttft_host --mode stages --lengths 2000,8000,20000
    .venv/bin/python -m benchmarks.serving.bench_ttft_host --mode e2e --profile-dir /tmp/prof
    .venv/bin/python -m benchmarks.serving.bench_ttft_host --mode scheduler --lengths 2000,30000,112000 --host-kv-gib 64

``scheduler``: the scheduler alone, as its process runs it, for a token-id question over a cached document
of N tokens (``--lengths`` in tokens here), with a host KV tier of ``--host-kv-gib`` (0: none), one
question at a time and ``--burst`` at once (``scheduler_stages``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import ROOT
from radixrelay.bench.words import WORDS

NEW_WORDS = 5


def words(rng: np.random.Generator, n: int) -> str:
    return " ".join(rng.choice(WORDS, n))


def median_ms(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


# -- stages, in this process ----------------------------------------------------------------------


class _Info:
    def __init__(self, max_context: int, kv_cache_tokens: int, vocab_size: int) -> None:
        from radixrelay.protocol.messages import RuntimeReady

        self.info = RuntimeReady(kv_cache_tokens, max_context, vocab_size)


def stages(lengths: list[int], repeats: int, page_size: int) -> list[dict[str, Any]]:
    import msgspec

    from radixrelay.model.model_registry import resolve_model_path
    from radixrelay.protocol.messages import (
        FrontendMessage, GenerateRequest, RuntimeMessage, TokenUpdate, UpdateBatch, WorkerCommand, WorkerStep,
        decoder, encoder,
    )
    from radixrelay.radix.truncation import Truncated
    from radixrelay.scheduler import Scheduler
    from radixrelay.scheduler.scheduler_config import SchedulerConfig
    from radixrelay.server import openai_protocol as oa
    from radixrelay.server import serving
    from radixrelay.text.chat_template import ChatTemplate
    from radixrelay.server.grammar_check import GrammarCheck
    from radixrelay.server.prometheus_metrics import ServerMetrics
    from radixrelay.text.tokenizer import load_tokenizer
    from radixrelay.protocol.step import StepOutput

    tok = load_tokenizer(resolve_model_path("default"))
    template = ChatTemplate.for_tokenizer(tok)
    hf = getattr(tok._backend, "_tok", None)
    encoder_ = getattr(tok._backend, "encoder", None)
    enc = encoder().encode
    frontend_dec, worker_dec = decoder(FrontendMessage), decoder(WorkerCommand)
    runtime_dec = decoder(RuntimeMessage)
    rows = []
    for k, n in enumerate(lengths):
        rng = np.random.default_rng([0, k])
        base = words(rng, n)
        prompt = f"{base} {words(rng, NEW_WORDS)}"
        messages = [{"role": "user", "content": prompt}]
        body = msgspec.json.encode({"model": "m", "messages": messages, "max_tokens": 1})
        text = template.render(messages)
        first_text = template.render([{"role": "user", "content": base}])
        first_ids = tok.encode(first_text, add_special_tokens=False)
        ids = tok.encode(text, add_special_tokens=False)
        row: dict[str, Any] = {"words": n, "prompt_tokens": len(ids)}
        row["json body"] = median_ms(lambda: oa.decode_request(body, oa.ChatCompletionRequest), repeats)
        row["chat template"] = median_ms(lambda: template.render(messages), repeats)
        if hf is not None:
            row["tokenize (whole text)"] = median_ms(lambda: hf.encode(text, add_special_tokens=False),
                                                     repeats)

        def cold() -> None:
            if encoder_ is not None:
                encoder_.clear()
            tok.encode(text, add_special_tokens=False)

        row["tokenize (nothing cached)"] = median_ms(cold, repeats)
        tok.encode(first_text, add_special_tokens=False)
        # The probe's later prompts: the first prompt's chunks are cached, each tail is new.
        extended = iter([template.render([{"role": "user", "content": f"{base} {words(rng, NEW_WORDS)}"}])
                         for _ in range(repeats)])
        row["tokenize"] = median_ms(lambda: tok.encode(next(extended), add_special_tokens=False), repeats)
        req = oa.decode_request(body, oa.ChatCompletionRequest)
        ctx = serving.ServingContext(_Info(32768, 65536, tok.vocab_size), tok, template, "m", 1,
                                     ServerMetrics(), max_choices=1, grammars=GrammarCheck(tok))
        row["request -> choices"] = median_ms(lambda: serving._choices(ctx, req, [Truncated(ids)], [1], None), repeats)
        sampling = serving._choices(ctx, req, [Truncated(ids)], [1], None)[0].sampling
        msg = GenerateRequest(1, ids, sampling)
        row["ipc: request to scheduler"] = median_ms(lambda: frontend_dec.decode(enc(msg)), repeats)

        # Scheduler: the first prompt computed and cached, then the extended one admitted.
        sched_ms: dict[str, list[float]] = {"add_request": [], "schedule": [], "ipc: plan to worker": [],
                                            "process_output (finish)": [], "ipc: output to server": []}
        for _ in range(repeats):
            sched = Scheduler(SchedulerConfig(kv_cache_tokens=65536, page_size=page_size,
                                              eos_token_ids=tuple(tok.eos_token_ids)), detokenize=tok.decode)
            # Token ids as the scheduler gets them: decoded from a message, so distinct int objects
            # (comparing those costs more than comparing a list with itself).
            first = frontend_dec.decode(enc(GenerateRequest(0, first_ids, sampling)))
            _run(sched, 0, first.token_ids, sampling)
            received = frontend_dec.decode(enc(msg)).token_ids
            t0 = time.perf_counter()
            sched.add_request(1, received, sampling)
            t1 = time.perf_counter()
            plan = sched.schedule()
            t2 = time.perf_counter()
            worker_dec.decode(enc(WorkerStep(plan)))
            t3 = time.perf_counter()
            updates = sched.process_output(StepOutput(plan.step_id, [1], [42]))
            t4 = time.perf_counter()
            runtime_dec.decode(enc(UpdateBatch([TokenUpdate(u) for u in updates])))
            t5 = time.perf_counter()
            for key, a, b in (("add_request", t0, t1), ("schedule", t1, t2),
                              ("ipc: plan to worker", t2, t3), ("process_output (finish)", t3, t4),
                              ("ipc: output to server", t4, t5)):
                sched_ms[key].append((b - a) * 1e3)
            assert plan.admitted[0].token_offset > len(ids) - 2 * page_size - NEW_WORDS - 8, "not cached"
            row["plan bytes"] = len(enc(WorkerStep(plan)))
        row.update({k: statistics.median(v) for k, v in sched_ms.items()})
        update = updates[0]

        def respond() -> None:
            choices = serving._choices(ctx, req, [Truncated(ids)], [1], None)
            choices[0].output.apply(TokenUpdate(update))
            job = _Job(choices)
            msgspec.json.encode(serving.chat_response(ctx, job))

        row["output + response"] = median_ms(respond, repeats) - row["request -> choices"]
        host = [v for key, v in row.items() if isinstance(v, float) and key not in
                ("tokenize (whole text)", "tokenize (nothing cached)")]
        row["total host"] = sum(host)
        rows.append(row)
    return rows


# -- the scheduler alone, token-id prompts by length, in this process ----------------------------------

# Llama-3-8B's KV per 16-token page (32 layers x K/V x 8 heads x 128 x bf16): host pages per GiB
KV_BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2
VOCAB = 128256
QUESTION_TOKENS = 24


def scheduler_stages(lengths: list[int], repeats: int, page_size: int, host_kv_gib: float,
                     burst: int) -> list[dict[str, Any]]:
    """The scheduler's host work for a new question over a cached document of N tokens, as the scheduler
    process does it: the packed ids unpacked (``unpack_token_ids``), ``add_request``, the step that admits it
    (``schedule``), its output (``process_output``: max_tokens 1, so it finishes and gives its KV back,
    its new pages saved to the host tier) and the transfers plan with the save's acknowledgement. One
    scheduler per length: the document computed once, then ``repeats`` questions one at a time (an idle
    server), then ``burst`` questions arriving at once and admitted by one ``schedule``."""
    from radixrelay.protocol.kv import KVAcks
    from radixrelay.protocol.messages import (
        FrontendMessage, GenerateRequest, WorkerCommand, WorkerStep, decoder, encoder,
    )
    from radixrelay.protocol.step import StepOutput
    from radixrelay.radix.tiers import KVTiers
    from radixrelay.protocol.token_ids import pack_token_ids
    try:
        from radixrelay.protocol.token_ids import unpack_token_ids
    except ImportError:                          # before 2026-11-29: a table of shared int objects
        from radixrelay.protocol.token_ids import TokenTable
        unpack_token_ids = TokenTable(VOCAB).unpack
    from radixrelay.sampling_params import SamplingParams
    from radixrelay.scheduler import Scheduler
    from radixrelay.scheduler.scheduler_config import SchedulerConfig

    enc, dec = encoder().encode, decoder(FrontendMessage).decode
    step_encode, step_decode = encoder().encode, decoder(WorkerCommand).decode
    sampling = SamplingParams(max_tokens=1, temperature=0.0)
    rows = []
    for k, n in enumerate(lengths):
        rng = np.random.default_rng([2, k])
        doc = rng.integers(0, VOCAB, n, dtype=np.int32)
        kv_tokens = max(1 << 18, 2 * (n + burst * 2 * QUESTION_TOKENS))
        host_pages = int(host_kv_gib * (1 << 30) // (KV_BYTES_PER_TOKEN * page_size))
        tiers = KVTiers(host_pages) if host_pages else None
        sched = Scheduler(SchedulerConfig(kv_cache_tokens=kv_tokens, page_size=page_size,
                                          max_running_requests=max(256, burst)), tiers=tiers)
        rid = iter(range(1 << 30))

        def wire(ids: np.ndarray) -> GenerateRequest:
            # as the scheduler receives it: the frontend's packed ids, through msgspec
            return dec(enc(GenerateRequest(next(rid), pack_token_ids(ids), sampling)))

        def question() -> np.ndarray:
            return np.concatenate([doc, rng.integers(0, VOCAB, QUESTION_TOKENS, dtype=np.int32)])

        def drive(plan) -> None:
            rids = [e.rid for e in plan.extends if e.sample] + list(plan.decodes)
            acks = KVAcks(saved_steps=[plan.step_id]) if plan.transfers and plan.transfers.saves else None
            sched.process_output(StepOutput(plan.step_id, rids, [42] * len(rids), kv_acks=acks))

        def drain() -> None:
            while sched.has_work():
                drive(sched.schedule())

        first = wire(question())
        sched.add_request(first.rid, unpack_token_ids(first.token_ids), sampling)
        drain()
        times: dict[str, list[float]] = {"unpack + add_request": [], "schedule (admission)": [],
                                         "process_output (finish, release)": [], "save acks": []}
        for _ in range(repeats + 1):                 # the first question warms up (splits the document node)
            msg = wire(question())
            t0 = time.perf_counter()
            sched.add_request(msg.rid, unpack_token_ids(msg.token_ids), sampling)
            t1 = time.perf_counter()
            plan = sched.schedule()
            t2 = time.perf_counter()
            drive(plan)
            t3 = time.perf_counter()
            drain()
            t4 = time.perf_counter()
            assert plan.admitted[0].token_offset >= n - page_size, "not cached"
            for key, a, b in zip(times, (t0, t1, t2, t3), (t1, t2, t3, t4)):
                times[key].append((b - a) * 1e3)
        row: dict[str, Any] = {"prompt_tokens": n + QUESTION_TOKENS}
        row.update({key: statistics.median(v[1:]) for key, v in times.items()})
        row["total"] = sum(row[key] for key in times)
        if burst:
            bursts, wires = [], []
            for _ in range(3):
                msgs = [wire(question()) for _ in range(burst)]
                t0 = time.perf_counter()
                for msg in msgs:
                    sched.add_request(msg.rid, unpack_token_ids(msg.token_ids), sampling)
                on_wire = 0.0
                while sched.has_work():
                    plan = sched.schedule()
                    t1 = time.perf_counter()
                    step_decode(step_encode(WorkerStep(plan)))      # the scheduler sends it, the worker reads it
                    on_wire += time.perf_counter() - t1
                    drive(plan)
                bursts.append((time.perf_counter() - t0) * 1e3)
                wires.append(on_wire * 1e3)
            row[f"burst of {burst}: all, per request"] = statistics.median(bursts) / burst
            row[f"burst of {burst}: of which plans encoded + decoded, per request"] = statistics.median(wires) / burst
        rows.append(row)
        print(f"  {n + QUESTION_TOKENS:7d} tokens: " + ", ".join(
            f"{key} {v:.3f}" for key, v in row.items() if isinstance(v, float)), flush=True)
    return rows


class _Job:
    def __init__(self, choices: list) -> None:
        self.choices = choices


def _run(sched, rid: int, ids: list[int], sampling) -> None:
    from radixrelay.protocol.step import StepOutput

    sched.add_request(rid, ids, sampling)
    while sched.has_work():
        plan = sched.schedule()
        rids = [e.rid for e in plan.extends if e.sample] + list(plan.decodes)
        sched.process_output(StepOutput(plan.step_id, rids, [42] * len(rids)))


def print_stages(rows: list[dict[str, Any]]) -> None:
    keys = [k for k in rows[0] if k not in ("words", "prompt_tokens")]
    print("\nstages (ms, median; host work of one cached-prompt request)")
    print(f"{'stage':28s}" + "".join(f"{r['prompt_tokens']:>10d}" for r in rows) + "  tokens")
    for key in keys:
        cells = "".join(f"{r[key]:10.3f}" if isinstance(r[key], float) else f"{r[key]:10d}" for r in rows)
        print(f"{key:28s}{cells}")


# -- end to end, the real server ----------------------------------------------------------------------


def _tiny_model(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 32768, "tie_word_embeddings": False}))
    return path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _e2e(lengths: list[int], repeats: int, server_args: list[str],
               profile_dir: str | None) -> list[dict]:
    import httpx

    model = _tiny_model(Path(tempfile.mkdtemp(prefix="ttft_model_")))
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": pythonpath}
    # One torch thread: the CPU forward's thread pool stalls badly when other processes share the
    # cores, which would swamp the host costs measured here.
    env.setdefault("OMP_NUM_THREADS", "1")
    if profile_dir:
        env["RADIXRELAY_PROFILE_DIR"] = profile_dir
    argv = [sys.executable, "-m", "radixrelay.cli", "serve", "--port", str(port), "--model", str(model),
            "--load-format", "dummy", "--tokenizer", "default", "--device", "cpu",
            "--kv-cache-tokens", "65536", "--log-level", "warning", *server_args]
    proc = subprocess.Popen(argv, env=env, start_new_session=True)
    rows = []
    try:
        async with httpx.AsyncClient(timeout=600) as http:
            deadline = time.monotonic() + 300
            while True:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the server did not start")
                try:
                    if (await http.get(f"{url}/health")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.5)
            for k, n in enumerate(lengths):
                for endpoint in ("chat", "completions"):
                    rng = np.random.default_rng([1, k])
                    await http.post(f"{url}/flush_cache")
                    base = words(rng, n)

                    def body(text: str) -> dict[str, Any]:
                        if endpoint == "chat":
                            return {"model": str(model), "messages": [{"role": "user", "content": text}],
                                    "max_tokens": 1}
                        return {"model": str(model), "prompt": text, "max_tokens": 1}

                    path = f"{url}/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}"
                    (await http.post(path, json=body(base))).raise_for_status()
                    before = await _scrape(http, url)
                    ttft, usage = [], {}
                    for _ in range(repeats):
                        start = time.perf_counter()
                        reply = await http.post(path, json=body(f"{base} {words(rng, NEW_WORDS)}"))
                        ttft.append((time.perf_counter() - start) * 1e3)
                        reply.raise_for_status()
                        usage = reply.json()["usage"]
                    after = await _scrape(http, url)
                    steps = after["steps"] - before["steps"]
                    row = {"words": n, "endpoint": endpoint, "prompt_tokens": usage["prompt_tokens"],
                           "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                           "ttft_p50_ms": statistics.median(ttft), "ttft_min_ms": min(ttft),
                           "steps_per_request": steps / repeats,
                           "worker_ms_per_step": 1e3 * (after["worker_busy"] - before["worker_busy"]) / steps,
                           "scheduler_ms_per_step":
                               1e3 * (after["scheduler_busy"] - before["scheduler_busy"]) / steps}
                    rows.append(row)
                    print(f"  {n:6d} words {endpoint:11s} prompt {row['prompt_tokens']:6d} "
                          f"cached {row['cached_tokens']:6d}  TTFT p50 {row['ttft_p50_ms']:6.1f} ms "
                          f"(min {row['ttft_min_ms']:5.1f})  "
                          f"worker {row['worker_ms_per_step']:5.1f} ms/step  "
                          f"scheduler {row['scheduler_ms_per_step']:5.2f} ms/step", flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    return rows


async def _scrape(http, url: str) -> dict[str, float]:
    text = (await http.get(f"{url}/metrics")).text
    values = {}
    for line in text.splitlines():
        if line.startswith("radixrelay_") and " " in line and "{" not in line:
            name, value = line.split()[:2]
            values[name] = float(value)
    return {"steps": values["radixrelay_steps_total"],
            "worker_busy": values["radixrelay_worker_busy_seconds_total"],
            "scheduler_busy": values["radixrelay_scheduler_busy_seconds_total"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("stages", "scheduler", "e2e", "both"), default="both")
    p.add_argument("--lengths", default="2000,8000,20000", help="prompt lengths in words (~tokens)")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--server-args", default="", help="more `radixrelay serve` options, one string")
    p.add_argument("--profile-dir", default=None, help="e2e: cProfile the scheduler and worker into DIR")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--host-kv-gib", type=float, default=0.0,
                   help="scheduler: a host KV tier of this size (Llama-3-8B pages), 0 for none")
    p.add_argument("--burst", type=int, default=32, help="scheduler: questions arriving at once (0: none)")
    args = p.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    out: dict[str, Any] = {}
    if args.mode in ("stages", "both"):
        out["stages"] = stages(lengths, args.repeats, args.page_size)
        print_stages(out["stages"])
    if args.mode == "scheduler":
        print(f"\nscheduler (ms, median; a new question over a cached document, host tier "
              f"{args.host_kv_gib:g} GiB)")
        out["scheduler"] = scheduler_stages(lengths, args.repeats, args.page_size, args.host_kv_gib, args.burst)
    if args.mode in ("e2e", "both"):
        print("\ne2e: the real server, tiny dummy model on the CPU, cached prompt + 5 new words")
        out["e2e"] = asyncio.run(_e2e(lengths, args.repeats, args.server_args.split(), args.profile_dir))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
