"""A torch-profiler trace of a window of worker steps (``RADIXRELAY_TRACE_STEPS``, see ``radixrelay.env``).

Each traced launch is wrapped in a ``record_function("step <id>")`` range, so the Chrome trace ties
the host work of a step to the kernels it launched (``benchmarks/serving/trace_summary.py`` reads it back:
per step, host launch span, device kernel time and device span, and the gaps between kernels).
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch

logger = logging.getLogger("radixrelay.worker")


class StepTrace:
    def __init__(self, start: int, count: int, out_dir: str, rank: int = 0) -> None:
        """Trace launches ``[start, start + count)`` (0 = the first launch after ready); tensor-parallel
        rank ``rank`` > 0 writes ``worker_trace_rank<r>.*`` beside rank 0's ``worker_trace.*``."""
        self.start, self.stop = start, start + count
        self.out_dir = out_dir
        self.name = "worker_trace" if rank == 0 else f"worker_trace_rank{rank}"
        self._launches = 0
        self._profiler: torch.profiler.profile | None = None
        self._last_step_id: int | None = None      # the window's last step: stop once it is finished
        self.done = False

    def launch(self, step_id: int) -> contextlib.AbstractContextManager:
        """Context for launching one step: starts the profiler at the window's first launch."""
        n = self._launches
        self._launches += 1
        if self.done or n < self.start or n >= self.stop:
            return contextlib.nullcontext()
        if self._profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities)
            self._profiler.start()
        if n == self.stop - 1:
            self._last_step_id = step_id
        return torch.profiler.record_function(f"step {step_id}")

    def finished(self, step_id: int) -> None:
        """Called after each step's output was sent: ends the trace after the window's last step."""
        if self._profiler is None or self.done or step_id != self._last_step_id:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._profiler.stop()
        self.done = True
        os.makedirs(self.out_dir, exist_ok=True)
        trace = os.path.join(self.out_dir, f"{self.name}.json")
        self._profiler.export_chrome_trace(trace)
        table = self._profiler.key_averages().table(sort_by="self_cuda_time_total", row_limit=50)
        with open(os.path.join(self.out_dir, f"{self.name}.txt"), "w") as f:
            f.write(f"launches [{self.start}, {self.stop}) after ready\n\n{table}\n")
        logger.info("step trace of launches [%d, %d) written to %s", self.start, self.stop, trace)
