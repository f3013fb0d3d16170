"""Device time of short kernels, from CUDA-graph replays (timing them eagerly measures their launch)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def graph_replay_seconds(body: Callable[[], None], replays: int, warmup: int = 3) -> list[float]:
    """``body`` (the calls to time, on the current stream) captured once in a CUDA graph, replayed ``warmup``
    times untimed, then ``replays`` times: the seconds of each timed replay (CUDA events around it)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    for _ in range(warmup):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del graph
    return times
