"""Start-up measurement of a rank's all-reduce time per row count (CUDA), for ``AllReduceClock``.

Every rank runs the same sequence (the all-reduces are collectives): for each row count, a CUDA graph
of ``REPEATS`` all-reduces of a ``[rows, hidden]`` activation is captured through the model's own
``TensorParallel.all_reduce`` (symmetric memory or NCCL, as serving picks), replayed once to warm up,
then timed over ``TIMED`` replays with CUDA events; the median divided by ``REPEATS`` is one call.
"""

from __future__ import annotations

import logging
import statistics

import torch

from radixrelay.kernels.graph_timing import graph_replay_seconds
from radixrelay.model.parallel import TensorParallel

logger = logging.getLogger("radixrelay.worker")

REPEATS = 8
TIMED = 5


def row_counts(max_rows: int) -> list[int]:
    """Powers of two from 1 below ``max_rows``, then ``max_rows``."""
    rows, r = [], 1
    while r < max_rows:
        rows.append(r)
        r *= 2
    return rows + [max(1, max_rows)]


def calibrate_all_reduce(tp: TensorParallel, hidden: int, dtype: torch.dtype, device: torch.device,
                         max_rows: int) -> None:
    """Measure and install the rank's all-reduce times (``tp.clock.calibrated``)."""
    rows = row_counts(max_rows)
    seconds = []
    for n in rows:
        x = torch.zeros(n, hidden, dtype=dtype, device=device)
        tp.all_reduce(x)                               # eager once: NCCL's communicator and buffers

        def body(x=x) -> None:
            for _ in range(REPEATS):
                tp.all_reduce(x)

        seconds.append(statistics.median(graph_replay_seconds(body, TIMED, warmup=1)) / REPEATS)
        del x
    torch.cuda.empty_cache()           # the KV cache is sized from the free memory after this
    tp.clock.calibrated(rows, seconds)
    shown = ", ".join(f"{n} rows {s * 1e6:.0f} us" for n, s in zip(rows, seconds) if n in (1, 256, rows[-1]))
    logger.info("rank %d all-reduce per call (start-up, graph replays): %s", tp.rank, shown)
