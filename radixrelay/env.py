"""Environment variables radixrelay reads, all prefixed ``RADIXRELAY_``, in one place.

- ``RADIXRELAY_API_KEY``: the server's API key when neither ``--api-key`` nor ``--api-key-file`` is given
  (an environment variable, unlike a command-line flag, is not shown to other users by ``ps``).
- ``RADIXRELAY_GRAMMAR_BUDGET_MS``: host milliseconds per token a structured output's grammar may take
  on average over its last 16 tokens before its request fails with an error (default 10;
  ``radixrelay.worker.constraints.MaskBudget``): what one hostile constraint can cost its batch mates.
- ``RADIXRELAY_PROFILE_DIR``: when set, each runtime child process (scheduler, worker) runs under
  cProfile and writes ``<name>.prof`` and a text summary ``<name>.txt`` there when it exits
  normally. For finding where a step's host time goes; profiling slows Python code down.
- ``RADIXRELAY_TRACE_STEPS``: ``START:COUNT``; the worker records steps ``[START, START + COUNT)``
  (counted from the first step after ready) with the torch profiler, CPU and CUDA activity, and
  writes ``worker_trace.json`` (a Chrome trace) and ``worker_trace.txt`` (ops by device time and a
  per-step summary: host launch span, device kernel time, device span) to ``RADIXRELAY_PROFILE_DIR``
  (the current directory if unset). Not combined with the cProfile run above in one process.
- ``RADIXRELAY_STEP_LOG``: a file path; the scheduler writes its timeline there (request arrivals,
  each step sent with its rows and the page ids it carries, each step's output with its device time;
  ``radixrelay.scheduler.step_log``).
  For seeing which step served a request of a burst.
- ``RADIXRELAY_OVERLAP_DEPTH``: steps the scheduler keeps in flight with overlap on (2 when unset: step
  N+1 is planned while N computes). For measuring deeper pipelines; a finished request may then compute
  up to depth - 1 tokens that are never streamed.
- ``RADIXRELAY_SMALL_EXTEND_ROWS``: extend tokens a step may run as decode-graph rows (the worker's
  ``SMALL_EXTEND_ROWS``, 256, when unset; 0: never, every step with an extend runs piecewise). For
  comparing the two paths.
- ``RADIXRELAY_CPU_GEMM``: ``auto`` (default), ``onednn`` or ``blas``: how the model's float32 matrix
  products run on the CPU (``radixrelay.model.cpu_gemm``: oneDNN's matmul, or torch's ``F.linear``
  for comparisons). Read when the model module is imported; the runtime's children inherit it.
- ``RADIXRELAY_GC``: ``managed`` (default) or ``python``: how the runtime's processes run Python's
  garbage collector (``radixrelay.proc.gc_control``: start-up heap frozen, full collections when
  idle; or the interpreter's own policy, for comparison).
- ``RADIXRELAY_TP_ALLREDUCE``: ``auto`` (default), ``peer``, ``symm`` or ``nccl``: with tensor parallelism
  on CUDA, how all-reduces of up to 8 MiB run (``radixrelay.model.parallel``): ``peer``, our one-shot
  kernel over symmetric memory (``radixrelay.kernels.all_reduce``; what ``auto`` picks); ``symm``,
  torch's one-shot over symmetric memory; ``nccl``, the process group's NCCL for every size.
- ``RADIXRELAY_STEP_TIMEOUT_S``: seconds a worker step (every rank's) may stay unfinished before that
  worker process counts as hung and exits, failing the runtime (default 120; 0: never;
  ``radixrelay.worker.step_watchdog``).

``check_all`` reads every one that has a format; the CLI and the runtime's launcher run it
(``radixrelay.runtime.preflight``) before any process starts, so a malformed value is a start-up error
naming the variable, never a child process failing after the server said it was ready.
"""

from __future__ import annotations

import os


def api_key_env() -> str | None:
    """``RADIXRELAY_API_KEY``; None when unset or empty."""
    return os.environ.get("RADIXRELAY_API_KEY") or None


def _number(name: str, what: str, ok) -> float | None:
    """``name`` as a float for which ``ok`` holds; None when unset or empty. Anything else is an error
    saying ``what`` it must be."""
    text = os.environ.get(name)
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not ok(value):
        raise ValueError(f"{name} must be {what}, got {text!r}")
    return value


def _choice(name: str, choices: tuple[str, ...]) -> str:
    """``name``, one of ``choices`` (the first when unset or empty); anything else is an error."""
    value = os.environ.get(name) or choices[0]
    if value not in choices:
        raise ValueError(f"{name} must be {' or '.join(repr(c) for c in choices)}, got {value!r}")
    return value


def grammar_budget_ms() -> float | None:
    """``RADIXRELAY_GRAMMAR_BUDGET_MS`` as a float > 0; None when unset. A malformed value is an error."""
    return _number("RADIXRELAY_GRAMMAR_BUDGET_MS", "a number of milliseconds > 0", lambda v: v > 0)


def profile_dir() -> str | None:
    return os.environ.get("RADIXRELAY_PROFILE_DIR") or None


def step_log_path() -> str | None:
    """``RADIXRELAY_STEP_LOG``: where the scheduler writes its timeline; None when unset."""
    return os.environ.get("RADIXRELAY_STEP_LOG") or None


def trace_steps() -> tuple[int, int] | None:
    """``RADIXRELAY_TRACE_STEPS`` as (start, count); None when unset. A malformed value is an error."""
    text = os.environ.get("RADIXRELAY_TRACE_STEPS")
    if not text:
        return None
    start, sep, count = text.partition(":")
    try:
        window = int(start), int(count)
    except ValueError:
        window = None
    if not sep or window is None or window[0] < 0 or window[1] < 1:
        raise ValueError(f"RADIXRELAY_TRACE_STEPS must be START:COUNT (START >= 0, COUNT >= 1), got {text!r}")
    return window


def small_extend_rows() -> int | None:
    """``RADIXRELAY_SMALL_EXTEND_ROWS`` as an int >= 0; None when unset. A malformed value is an error."""
    text = os.environ.get("RADIXRELAY_SMALL_EXTEND_ROWS")
    if not text:
        return None
    if not text.isdigit():
        raise ValueError(f"RADIXRELAY_SMALL_EXTEND_ROWS must be an integer >= 0, got {text!r}")
    return int(text)


def overlap_depth() -> int:
    """``RADIXRELAY_OVERLAP_DEPTH`` (default 2); a malformed or smaller-than-2 value is an error."""
    text = os.environ.get("RADIXRELAY_OVERLAP_DEPTH")
    if not text:
        return 2
    try:
        depth = int(text)
    except ValueError:
        depth = 0
    if depth < 2:
        raise ValueError(f"RADIXRELAY_OVERLAP_DEPTH must be an integer >= 2, got {text!r}")
    return depth


def gc_mode() -> str:
    """``RADIXRELAY_GC`` (default ``managed``); any other value than ``managed`` or ``python`` is an error."""
    return _choice("RADIXRELAY_GC", ("managed", "python"))


def step_timeout_s() -> float:
    """``RADIXRELAY_STEP_TIMEOUT_S`` (default 120; 0 turns the watchdog off); a malformed value is an error."""
    value = _number("RADIXRELAY_STEP_TIMEOUT_S", "a finite number of seconds > 0, or 0 for no step watchdog",
                    lambda v: 0 <= v < float("inf"))
    return 120.0 if value is None else value


def tp_all_reduce() -> str:
    """``RADIXRELAY_TP_ALLREDUCE`` (default ``auto``): auto, peer, symm or nccl; any other value is an error."""
    return _choice("RADIXRELAY_TP_ALLREDUCE", ("auto", "peer", "symm", "nccl"))


CPU_GEMM_MODES = ("auto", "onednn", "blas")


def cpu_gemm() -> str:
    """``RADIXRELAY_CPU_GEMM`` (default ``auto``): auto, onednn or blas; any other value is an error
    (``radixrelay.model.cpu_gemm`` reads it when imported and checks it on first use)."""
    return _choice("RADIXRELAY_CPU_GEMM", CPU_GEMM_MODES)


def check_all() -> None:
    """Read every variable above that has a format: a malformed one raises ``ValueError`` naming it.
    Run before any runtime process starts (``radixrelay.runtime.preflight``), so that a bad value is a
    start-up error and not a child process failing later, after the server said it was ready."""
    for read in (grammar_budget_ms, trace_steps, small_extend_rows, overlap_depth, gc_mode, step_timeout_s,
                 tp_all_reduce, cpu_gemm):
        read()
