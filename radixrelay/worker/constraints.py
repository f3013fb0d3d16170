"""Structured-output constraints on the worker: a grammar matcher per constrained resident request,
and the mask of a step's sampling rows.

Timing (overlap): step N+1 is launched before step N's tokens reach the host. A constrained row of
step N+1 needs its matcher advanced by its step-N token, so ``mask`` runs after step N+1's forward
has been queued on the device: it waits for step N's tokens (``sampled`` queued a reader for them),
advances the matchers, fills the next-token bitmask on the host while the device computes the
forward, and masks the logits before sampling. Steps without constrained rows never wait.

Grammars compile in a worker thread from admission on (xgrammar releases the GIL), so a new schema
is compiled while the request's prompt is prefilled; the first mask waits for it if needed.

A matcher that has terminated (its request emitted EOS and the scheduler drops the extra token it
planned one step late) leaves its row unmasked; one that rejects a token (which the mask should make
impossible) allows only EOS from then on, so its request ends rather than leaving its grammar.

Budget: a constrained request's host time in its grammar (accepting tokens, filling masks) is what its
batch mates wait for. A request whose grammar took more than ``MaskBudget.per_token_s`` per token over
its last ``MaskBudget.window`` tokens (or more than ``MaskBudget.single_s`` for one token) fails with a
clear error (``take_failed``: the step output's ``failed``), and allows only EOS until the scheduler
drops it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from radixrelay.structured.grammar import GrammarEngine
from radixrelay.structured.spec import StructuredOutput

logger = logging.getLogger("radixrelay.worker")
_SHIFTS = torch.arange(32, dtype=torch.int32)


@dataclass(frozen=True)
class MaskBudget:
    """Host time a request's grammar may take: ``per_token_s`` on average over its last ``window``
    tokens, ``single_s`` for any one token (seconds)."""

    per_token_s: float = 0.010
    window: int = 16
    single_s: float = 0.250

    def __post_init__(self) -> None:
        if self.per_token_s <= 0 or self.single_s <= 0 or self.window < 1:
            raise ValueError(f"MaskBudget: bad limits {self}")


class _Matcher:
    """One request's grammar state; ``replay``: its output tokens so far (a re-admitted request)."""

    def __init__(self, rid: int, grammar: Future, replay: list[int]) -> None:
        self.rid = rid
        self._grammar = grammar
        self._replay = replay
        self._matcher: Any = None
        self.broken = False
        self.over_budget: str | None = None      # why the request failed its budget (None: within it)
        self._recent: deque[float] = deque()     # host seconds of its last tokens (at most the window)

    def charge(self, seconds: float, budget: MaskBudget) -> None:
        """Record one token's grammar time; past the budget the request fails (only EOS from now on)."""
        if self.over_budget is not None:
            return
        self._recent.append(seconds)
        if len(self._recent) > budget.window:
            self._recent.popleft()
        if seconds > budget.single_s:
            self.over_budget = (f"structured output too costly: its grammar took {seconds * 1e3:.3g} ms of host "
                                f"time for one token (limit {budget.single_s * 1e3:.3g} ms)")
        elif len(self._recent) == budget.window and sum(self._recent) > budget.per_token_s * budget.window:
            mean = sum(self._recent) / budget.window
            self.over_budget = (f"structured output too costly: its grammar took {mean * 1e3:.3g} ms of host "
                                f"time per token over {budget.window} tokens (limit {budget.per_token_s * 1e3:.3g} "
                                f"ms); simplify the schema or regex")

    def get(self, engine: GrammarEngine) -> Any:
        if self._matcher is None:
            try:
                self._matcher = engine.matcher(self._grammar.result())
            except Exception as exc:  # noqa: BLE001 - frontends compile first; this is a safety net
                logger.error("request %d: grammar unusable on the worker: %s", self.rid, exc)
                self.broken = True
                return None
            for token in self._replay:
                self.accept(engine, token)
            self._replay = []
        return self._matcher

    def accept(self, engine: GrammarEngine, token: int) -> None:
        matcher = self.get(engine)
        if matcher is None or self.broken or matcher.is_terminated():
            return
        if not matcher.accept_token(token):
            logger.error("request %d: token %d rejected by its grammar; only EOS is allowed from now on",
                         self.rid, token)
            self.broken = True


class Constraints:
    def __init__(self, make_engine: Callable[[], GrammarEngine], device: torch.device,
                 budget: MaskBudget | None = None) -> None:
        self._make_engine = make_engine
        self.budget = budget or MaskBudget()
        self._failed: list[tuple[int, str]] = []     # (rid, why) found over budget, not yet reported
        self._engine: GrammarEngine | None = None
        self._host = _MaskBuffers(device)
        self._pool: ThreadPoolExecutor | None = None
        self._matchers: dict[int, _Matcher] = {}
        # Sampled tokens not yet accepted: (matcher of each row or None, reader of the step's tokens).
        self._pending: deque[tuple[list[_Matcher | None], Callable[[], list[int]]]] = deque()

    def __bool__(self) -> bool:
        return bool(self._matchers)

    def admit(self, rid: int, spec: StructuredOutput, outputs: list[int]) -> None:
        if self._engine is None:
            self._engine = self._make_engine()
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._matchers[rid] = _Matcher(rid, self._pool.submit(self._engine.compile, spec), list(outputs))

    def release(self, rid: int) -> None:
        self._matchers.pop(rid, None)

    def take_failed(self) -> list[tuple[int, str]]:
        """Requests found over their budget since the last call: (rid, why), each reported once."""
        failed, self._failed = self._failed, []
        return failed

    def waits_for_tokens(self) -> bool:
        """Whether the next ``mask`` waits for sampled tokens not yet read (a step still on the device)."""
        return bool(self._pending)

    def sampled(self, rids: list[int], tokens: Callable[[], list[int]]) -> None:
        """A step sampled ``rids``; ``tokens()`` returns their tokens (waiting for the device)."""
        rows = [self._matchers.get(rid) for rid in rids]
        if any(m is not None for m in rows):
            self._pending.append((rows, tokens))

    def mask(self, rids: list[int], logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [len(rids), V] with every token a constrained row's grammar forbids at -inf (a new
        tensor; unconstrained rows unchanged)."""
        engine = self._engine
        assert engine is not None
        spent: dict[int, float] = {}                  # id(matcher) -> host seconds this step
        while self._pending:
            rows, tokens = self._pending.popleft()
            for matcher, token in zip(rows, tokens(), strict=True):
                if matcher is not None:
                    start = time.perf_counter()
                    matcher.accept(engine, token)
                    spent[id(matcher)] = spent.get(id(matcher), 0.0) + time.perf_counter() - start
        constrained = [(i, self._matchers[rid]) for i, rid in enumerate(rids) if rid in self._matchers]
        rows: list[int] = []
        bitmask = self._host.bitmask(len(constrained), engine.vocab_size)        # [k, ceil(V / 32)] int32
        for i, matcher in constrained:
            state = matcher.get(engine)                # may wait for the compile: not charged
            start = time.perf_counter()
            if matcher.broken or state is None or matcher.over_budget is not None:
                bitmask[len(rows)] = 0
                for eos in engine.info.stop_token_ids:
                    bitmask[len(rows), eos // 32] |= 1 << (eos % 32)
            elif state.is_terminated():
                continue
            else:
                state.fill_next_token_bitmask(bitmask, len(rows))
                matcher.charge(spent.get(id(matcher), 0.0) + time.perf_counter() - start, self.budget)
                if matcher.over_budget is not None:
                    logger.warning("request %d: %s", matcher.rid, matcher.over_budget)
                    self._failed.append((matcher.rid, matcher.over_budget))
            rows.append(i)
        if not rows:
            return logits
        return self._host.apply(logits, rows, bitmask[:len(rows)])


class _MaskBuffers:
    """Host buffers of the masks, page-locked on CUDA: a copy from pageable memory would make the host
    wait until the device reaches it in the stream, that is for the whole forward just queued. One
    set is reused: before refilling it, the host waits for the copy of the previous mask (long done:
    the previous step's tokens, which the host has waited for, were sampled after it)."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._pin = device.type == "cuda"
        self._bits = torch.empty(0, 0, dtype=torch.int32)
        self._rows = torch.empty(0, dtype=torch.int64)
        self._shifts = _SHIFTS.to(device)
        self._copied: torch.cuda.Event | None = None

    def bitmask(self, rows: int, vocab: int) -> torch.Tensor:
        """A [rows, ceil(vocab / 32)] int32 buffer to fill (all bits clear)."""
        if self._copied is not None:
            self._copied.synchronize()
        words = -(-vocab // 32)
        if self._bits.shape[0] < rows or self._bits.shape[1] != words:
            self._bits = torch.empty(max(rows, 2 * self._bits.shape[0]), words, dtype=torch.int32, pin_memory=self._pin)
            self._rows = torch.empty(self._bits.shape[0], dtype=torch.int64, pin_memory=self._pin)
        out = self._bits[:rows]
        out.zero_()
        return out

    def apply(self, logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> torch.Tensor:
        index = self._rows[:len(rows)]
        index.copy_(torch.tensor(rows, dtype=torch.int64))
        masked = apply_bitmask(logits, index.to(self._device, non_blocking=True),
                               bitmask.to(self._device, non_blocking=True), self._shifts)
        if self._pin:
            self._copied = torch.cuda.Event()
            self._copied.record()
        return masked


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor,
                  shifts: torch.Tensor | None = None) -> torch.Tensor:
    """``logits`` [B, V] with row ``rows[j]`` keeping only the tokens whose bit is set in
    ``bitmask[j]`` (int32 [len(rows), ceil(V / 32)], bit ``t % 32`` of word ``t // 32``); a new tensor.
    ``rows`` int64 and ``bitmask`` on ``logits``' device."""
    vocab = logits.shape[-1]
    shifts = _SHIFTS.to(logits.device) if shifts is None else shifts
    bits = bitmask.unsqueeze(-1) >> shifts                                       # [k, W, 32]
    allowed = (bits & 1).view(bitmask.shape[0], -1)[:, :vocab].bool()            # [k, V]
    masked = logits.index_select(0, rows).masked_fill(~allowed, float("-inf"))
    return logits.index_copy(0, rows, masked)
