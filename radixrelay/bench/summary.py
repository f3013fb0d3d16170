"""Per-request records and the summary figures of a run.

Definitions (as vLLM's and SGLang's benchmarks use them, so numbers compare):
- TTFT: request sent -> first content chunk. Without streaming it equals the E2E latency.
- TPOT: (E2E - TTFT) / (completion tokens - 1), per request; requests of one token, or whose
  output came in one piece (non-streaming), have none.
- ITL: the gaps between consecutive content chunks, pooled over all requests.
- Goodput: completed requests per second that meet every SLO given (TTFT and/or TPOT).
- Cache hit ratio: sum of ``cached_tokens`` / sum of prompt tokens, over requests whose usage
  reported ``cached_tokens``.
- Multi-turn figures (``summary["multi_turn"]``, present when some request has ``turn >= 1``; see
  ``turn_summary``): TTFT of first turns, of later turns (``turn >= 1``) and of later turns whose
  history is long; the history hit rate; prompt tokens per second of TTFT of later turns.
  A later turn's history is everything the previous turn of its session sent and got back: that
  turn's ``prompt_tokens + completion_tokens``.
Token counts come from the server's ``usage``; where a server gives none, from a tokenizer (or an
estimate) of the prompt and reply text, and ``token_source`` says which.
All times in the JSON are milliseconds, except ``start_s`` and ``duration_s``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class RequestRecord:
    session: int
    turn: int
    label: str
    start_s: float                      # when it was sent, seconds after the run started
    ok: bool
    error: str | None
    max_tokens: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None
    token_source: str                   # "usage", "tokenizer" or "estimate"
    e2e_ms: float
    ttft_ms: float | None
    itl_ms: tuple[float, ...]

    @property
    def tpot_ms(self) -> float | None:
        if not self.ok or self.ttft_ms is None or self.completion_tokens < 2 or not self.itl_ms:
            return None
        return (self.e2e_ms - self.ttft_ms) / (self.completion_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        return {"session": self.session, "turn": self.turn, "label": self.label,
                "start_s": round(self.start_s, 6), "ok": self.ok, "error": self.error,
                "max_tokens": self.max_tokens, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "cached_tokens": self.cached_tokens,
                "token_source": self.token_source, "e2e_ms": self.e2e_ms, "ttft_ms": self.ttft_ms,
                "tpot_ms": self.tpot_ms, "itl_ms": list(self.itl_ms)}


@dataclass(frozen=True)
class SLO:
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def met_by(self, r: RequestRecord) -> bool:
        if not r.ok:
            return False
        if self.ttft_ms is not None and (r.ttft_ms is None or r.ttft_ms > self.ttft_ms):
            return False
        tpot = r.tpot_ms
        return self.tpot_ms is None or tpot is None or tpot <= self.tpot_ms

    @property
    def given(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None


def stats(values: list[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 (linear interpolation), or all None for no values."""
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    arr = np.asarray(values, dtype=float)
    return {"mean": float(arr.mean()),
            **{f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}}


HISTORY_THRESHOLD = 4096     # tokens of history from which a later turn counts as long-history


def turn_summary(records: list[RequestRecord],
                 history_threshold: int = HISTORY_THRESHOLD) -> dict[str, Any]:
    """Figures of multi-turn sessions, for KV held across turns (radix cache and the tiers
    behind it). Completed requests only; a later turn's history (``history_tokens``) is known
    when the previous turn of its session completed.

    - ``ttft_first_ms``, ``ttft_later_ms``: TTFT stats of first turns (``turn == 0``) and of
      later turns (``turn >= 1``); ``ttft_long_history_ms``: of later turns whose history is
      ``>= history_threshold`` tokens. ``first_turns``, ``later_turns``, ``long_history_turns``:
      how many TTFTs each holds.
    - ``history_hit_rate``: ``history_cached_tokens / history_tokens``, sums over the later turns
      whose history is known and whose usage reported ``cached_tokens`` (``None`` for none). It
      can pass 1 a little where the server caches template tokens after the reply.
    - ``uncached_prompt_tokens_per_ttft_s``: sum of ``prompt_tokens - cached_tokens`` over sum of
      TTFT seconds, later turns that reported ``cached_tokens``; ``prompt_tokens_per_ttft_s``: sum
      of ``prompt_tokens`` over sum of TTFT seconds, later turns. Not a prefill throughput: TTFT
      includes queueing and concurrent requests' TTFTs overlap; they compare runs of one workload.
    """
    done = [r for r in records if r.ok]
    by_turn = {(r.session, r.turn): r for r in done}

    def history(r: RequestRecord) -> int | None:
        prev = by_turn.get((r.session, r.turn - 1))
        return None if prev is None else prev.prompt_tokens + prev.completion_tokens

    first = [r for r in done if r.turn == 0 and r.ttft_ms is not None]
    later = [r for r in done if r.turn >= 1]
    timed = [r for r in later if r.ttft_ms is not None]
    long = [r for r in timed if (h := history(r)) is not None and h >= history_threshold]
    known = [(r, h) for r in later
             if r.cached_tokens is not None and (h := history(r)) is not None]
    history_tokens = sum(h for _, h in known)
    history_cached = sum(r.cached_tokens or 0 for r, _ in known)
    ttft_s = sum(r.ttft_ms or 0.0 for r in timed) / 1e3
    with_cache = [r for r in timed if r.cached_tokens is not None]
    with_cache_s = sum(r.ttft_ms or 0.0 for r in with_cache) / 1e3
    uncached = sum(r.prompt_tokens - (r.cached_tokens or 0) for r in with_cache)
    return {
        "history_threshold": history_threshold,
        "first_turns": len(first),
        "later_turns": len(timed),
        "long_history_turns": len(long),
        "ttft_first_ms": stats([r.ttft_ms for r in first if r.ttft_ms is not None]),
        "ttft_later_ms": stats([r.ttft_ms for r in timed if r.ttft_ms is not None]),
        "ttft_long_history_ms": stats([r.ttft_ms for r in long if r.ttft_ms is not None]),
        "history_tokens": history_tokens if known else None,
        "history_cached_tokens": history_cached if known else None,
        "history_hit_rate": history_cached / history_tokens if history_tokens else None,
        "uncached_prompt_tokens_per_ttft_s": uncached / with_cache_s if with_cache_s > 0 else None,
        "prompt_tokens_per_ttft_s":
            sum(r.prompt_tokens for r in timed) / ttft_s if ttft_s > 0 else None,
    }


def summarize(records: list[RequestRecord], duration_s: float, slo: SLO,
              history_threshold: int = HISTORY_THRESHOLD) -> dict[str, Any]:
    """The run's figures; ``summary["multi_turn"]`` (``turn_summary`` with
    ``history_threshold``) only where some request is a later turn (``turn >= 1``)."""
    done = [r for r in records if r.ok]
    prompt = sum(r.prompt_tokens for r in done)
    completion = sum(r.completion_tokens for r in done)
    with_cache = [r for r in done if r.cached_tokens is not None]
    cache_prompt = sum(r.prompt_tokens for r in with_cache)
    cached = sum(r.cached_tokens or 0 for r in with_cache)
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    summary: dict[str, Any] = {
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": dict(Counter(r.error for r in records if not r.ok).most_common()),
        "duration_s": duration_s,
        "request_throughput": len(done) * per_s,
        "input_token_throughput": prompt * per_s,
        "output_token_throughput": completion * per_s,
        "total_token_throughput": (prompt + completion) * per_s,
        "total_prompt_tokens": prompt,
        "total_completion_tokens": completion,
        "total_cached_tokens": cached if with_cache else None,
        "cache_hit_ratio": cached / cache_prompt if cache_prompt else None,
        "token_sources": dict(Counter(r.token_source for r in done)),
        "ttft_ms": stats([r.ttft_ms for r in done if r.ttft_ms is not None]),
        "tpot_ms": stats([t for r in done if (t := r.tpot_ms) is not None]),
        "itl_ms": stats([gap for r in done for gap in r.itl_ms]),
        "e2e_ms": stats([r.e2e_ms for r in done]),
    }
    if slo.given:
        good = sum(slo.met_by(r) for r in records)
        summary["slo"] = {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms}
        summary["goodput"] = good * per_s
        summary["slo_attainment"] = good / len(records) if records else None
    if any(r.turn >= 1 for r in records):
        summary["multi_turn"] = turn_summary(records, history_threshold)
    return summary
