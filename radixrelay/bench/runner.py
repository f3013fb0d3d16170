"""Plays a workload against a server: sessions start at their arrival times, turns follow their
previous reply (after the turn's think time), and at most ``max_concurrency`` requests are in
flight (the rest wait, and their timing starts when they are sent)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from radixrelay.bench.client import BenchClient, Message, Reply
from radixrelay.bench.metrics import RequestRecord
from radixrelay.bench.workloads import Session, Turn, estimate_tokens


@dataclass(frozen=True)
class TokenCounter:
    """Counts tokens of text where the server's usage gives none."""
    name: str                           # "tokenizer" or "estimate"
    count: Callable[[str], int]


def token_counter(tokenizer: str | None) -> TokenCounter:
    """radixrelay's tokenizer of ``tokenizer`` ('default', a HF model directory or a .gguf
    file), or the tokenizer-free estimate when None."""
    if tokenizer is None:
        return TokenCounter("estimate", estimate_tokens)
    from radixrelay.model.registry import resolve_model_path
    from radixrelay.server.tokenizer import load_tokenizer
    tok = load_tokenizer(resolve_model_path(tokenizer))
    return TokenCounter("tokenizer", lambda text: len(tok.encode(text, add_special_tokens=False)))


@dataclass(frozen=True)
class RunResult:
    records: list[RequestRecord]        # in the order they were sent
    duration_s: float                   # first arrival -> last reply


async def run_sessions(client: BenchClient, sessions: list[Session], arrivals: np.ndarray, *,
                       max_concurrency: int | None, counter: TokenCounter,
                       desc: str = "requests") -> RunResult:
    if len(arrivals) != len(sessions):
        raise ValueError(f"{len(arrivals)} arrival times for {len(sessions)} sessions")
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    records: list[RequestRecord] = []
    bar = tqdm(total=sum(len(s.turns) for s in sessions), desc=desc, unit="req", disable=None)
    start = time.perf_counter()

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
                               for i, (session, at) in enumerate(zip(sessions, arrivals))))
    finally:
        bar.close()
    duration = time.perf_counter() - start
    return RunResult(sorted(records, key=lambda r: r.start_s), duration)


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
