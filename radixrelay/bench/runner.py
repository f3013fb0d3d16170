"""Plays a workload against a server: sessions start at their arrival times, turns follow their
previous reply (after the turn's think time), and at most ``max_concurrency`` requests are in
flight (the rest wait, and their timing starts when they are sent).

One client process's own CPU becomes the limit before a GPU server's does: driving a saturating load
from one process, the client uses a full core and offers less than the server could serve
(benchmarks/results/HISTORY.md, 2026-11-24). ``run_sessions_parallel`` splits the sessions over several
processes that keep the same arrival schedule from a common start.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import queue
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from radixrelay.bench.http_client import BenchClient, ClientConfig, Message, Reply
from radixrelay.bench.summary import RequestRecord
from radixrelay.bench.workloads import Session, Turn, estimate_tokens


@dataclass(frozen=True)
class TokenCounter:
    """Counts tokens of text where the server's usage gives none."""
    name: str                           # "tokenizer" or "estimate"
    count: Callable[[str], int]
    tokenizer: str | None = None        # what ``token_counter`` was given (rebuilds it in a child process)


def token_counter(tokenizer: str | None) -> TokenCounter:
    """radixrelay's tokenizer of ``tokenizer`` ('default', a HF model directory or a .gguf
    file), or the tokenizer-free estimate when None."""
    if tokenizer is None:
        return TokenCounter("estimate", estimate_tokens)
    from radixrelay.model.model_registry import resolve_model_path
    from radixrelay.text.tokenizer import load_tokenizer
    tok = load_tokenizer(resolve_model_path(tokenizer))
    return TokenCounter("tokenizer", lambda text: len(tok.encode(text, add_special_tokens=False)), tokenizer)


@dataclass(frozen=True)
class RunResult:
    records: list[RequestRecord]        # in the order they were sent
    duration_s: float                   # first arrival -> last reply


async def run_sessions(client: BenchClient, sessions: list[Session], arrivals: np.ndarray, *,
                       max_concurrency: int | None, counter: TokenCounter,
                       desc: str = "requests", indices: Sequence[int] | None = None,
                       start: float | None = None, progress: bool = True) -> RunResult:
    """``arrivals``: seconds after ``start`` (a ``time.perf_counter()`` reading; default: now) at which
    each session begins; ``indices``: the sessions' numbers in the records (default: their positions)."""
    if len(arrivals) != len(sessions):
        raise ValueError(f"{len(arrivals)} arrival times for {len(sessions)} sessions")
    if indices is None:
        indices = range(len(sessions))
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    records: list[RequestRecord] = []
    bar = tqdm(total=sum(len(s.turns) for s in sessions), desc=desc, unit="req",
               disable=None if progress else True)
    start = time.perf_counter() if start is None else start

    async def play(index: int, session: Session, at: float) -> None:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        history: list[Message] = []
        if session.system:
            history.append({"role": "system", "content": session.system})
        for k, turn in enumerate(session.turns):
            if turn.think_time:
                await asyncio.sleep(turn.think_time)
            messages = [*history, {"role": "user", "content": turn.user}]
            async with limit:
                sent = time.perf_counter() - start
                reply = await client.send(messages, turn.max_tokens)
            records.append(_record(index, k, session.label, sent, turn, messages, reply, counter))
            bar.update(1)
            history = [*messages, {"role": "assistant", "content": reply.text}]

    try:
        await asyncio.gather(*(play(i, session, float(at))
                               for i, session, at in zip(indices, sessions, arrivals)))
    finally:
        bar.close()
    duration = time.perf_counter() - start
    return RunResult(sorted(records, key=lambda r: r.start_s), duration)


# A child process that sends nothing for this long while its siblings finish is taken for hung.
_CHILD_GRACE_S = 60.0


async def run_sessions_parallel(config: ClientConfig, sessions: list[Session], arrivals: np.ndarray, *,
                                processes: int, counter: TokenCounter, desc: str = "requests") -> RunResult:
    """``run_sessions`` over ``processes`` client processes (session i in process i mod ``processes``), all
    timing their arrivals from one start. Records come back in send order, as from ``run_sessions``."""
    if processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    if len(arrivals) != len(sessions):
        raise ValueError(f"{len(arrivals)} arrival times for {len(sessions)} sessions")
    if processes == 1 or len(sessions) < 2:
        async with BenchClient(config) as client:
            return await run_sessions(client, sessions, arrivals, max_concurrency=None, counter=counter, desc=desc)
    processes = min(processes, len(sessions))
    return await asyncio.get_running_loop().run_in_executor(
        None, _run_children, config, sessions, np.asarray(arrivals, dtype=float), processes, counter.tokenizer)


def _run_children(config: ClientConfig, sessions: list[Session], arrivals: np.ndarray, processes: int,
                  tokenizer: str | None) -> RunResult:
    ctx = mp.get_context("spawn")         # no fork of a process with a running event loop
    ready, go = ctx.Barrier(processes + 1), ctx.Barrier(processes + 1)
    start, out = ctx.Value("d", 0.0), ctx.Queue()
    children = []
    for k in range(processes):
        idx = list(range(k, len(sessions), processes))
        child = ctx.Process(target=_child, daemon=True, args=(
            k, config, [sessions[i] for i in idx], arrivals[idx], idx, tokenizer, ready, go, start, out))
        child.start()
        children.append(child)
    try:
        try:
            ready.wait(timeout=120)                 # every child imported and made its client
            # perf_counter is CLOCK_MONOTONIC on Linux (mach_absolute_time on macOS): one clock for all.
            start.value = time.perf_counter() + 0.05
            go.wait(timeout=30)
        except threading.BrokenBarrierError:        # a child failed (or hung) before its start
            try:
                k, _, error = out.get(timeout=5)
            except queue.Empty:
                raise RuntimeError("bench client processes did not start in time") from None
            raise RuntimeError(f"bench client process {k} failed:\n{error}") from None
        records: list[RequestRecord] = []
        duration, pending = 0.0, set(range(processes))
        while pending:
            try:
                k, result, error = out.get(timeout=_CHILD_GRACE_S)
            except queue.Empty:
                dead = [k for k in pending if not children[k].is_alive()]
                if dead:
                    raise RuntimeError(f"bench client process {dead[0]} exited with code "
                                       f"{children[dead[0]].exitcode} without results") from None
                continue
            if error is not None:
                raise RuntimeError(f"bench client process {k} failed:\n{error}")
            pending.discard(k)
            records.extend(result.records)
            duration = max(duration, result.duration_s)
        return RunResult(sorted(records, key=lambda r: r.start_s), duration)
    finally:
        for child in children:
            child.join(timeout=5)
            if child.is_alive():
                child.kill()


def _child(k: int, config: ClientConfig, sessions: list[Session], arrivals: np.ndarray, indices: list[int],
           tokenizer: str | None, ready, go, start, out) -> None:
    try:
        counter = token_counter(tokenizer)

        async def main() -> RunResult:
            async with BenchClient(config) as client:
                ready.wait()
                go.wait()
                return await run_sessions(client, sessions, arrivals, max_concurrency=None, counter=counter,
                                          indices=indices, start=start.value, progress=False)

        out.put((k, asyncio.run(main()), None))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        ready.abort()       # a parent still waiting for the start learns of it at once
        go.abort()
        out.put((k, None, traceback.format_exc()))


def _record(session: int, turn_index: int, label: str, sent: float, turn: Turn,
            messages: list[Message], reply: Reply, counter: TokenCounter) -> RequestRecord:
    if reply.prompt_tokens is not None and reply.completion_tokens is not None:
        source, prompt, completion = "usage", reply.prompt_tokens, reply.completion_tokens
    else:
        source = counter.name
        prompt = sum(counter.count(m["content"]) for m in messages)
        completion = counter.count(reply.text)
    return RequestRecord(
        session=session, turn=turn_index, label=label, start_s=sent, ok=reply.ok,
        error=reply.error, max_tokens=turn.max_tokens, prompt_tokens=prompt,
        completion_tokens=completion, cached_tokens=reply.cached_tokens, token_source=source,
        e2e_ms=reply.latency * 1e3, ttft_ms=None if reply.ttft is None else reply.ttft * 1e3,
        itl_ms=tuple(gap * 1e3 for gap in reply.itl))
