"""Drive a real Scheduler + ModelRunner (no Engine) with a cascade mode, recording every step's logits
(as the sampler sees them).

``run_workload`` plays waves of requests: each wave is added once the previous one has finished, so
later waves hit the radix cache that earlier waves filled (that is how shared prefixes come to be
cached and then decoded together).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radixrelay.attention import AttentionBackend, KVCache, TorchBackend
from radixrelay.cascade.cost import CostModel, cost_model
from radixrelay.cascade.planner import CascadePlanner, make_cascade_planner
from radixrelay.model import LlamaForCausalLM
from radixrelay.protocol.step import ModuleSpan, StepPlan
from radixrelay.sampling_params import SamplingParams
from radixrelay.scheduler import Scheduler, SchedulerConfig
from radixrelay.worker.model_runner import ModelRunner

Wave = list[tuple[int, list[int]]]     # (rid, prompt)


class RecordingSampler:
    """The runner's sampler, keeping a copy of the logits it is given (eager or from a CUDA graph)."""

    def __init__(self, sampler) -> None:
        self.sampler = sampler
        self.last: torch.Tensor | None = None

    def __call__(self, logits, tensors):
        self.last = logits.clone()
        return self.sampler(logits, tensors)


@dataclass
class Result:
    tokens: dict[int, list[int]] = field(default_factory=dict)
    logits: list[dict[int, torch.Tensor]] = field(default_factory=list)   # per step: rid -> logits row
    plans: list[StepPlan] = field(default_factory=list)
    planner: CascadePlanner | None = None
    graphs: object | None = None           # the DecodeGraphs used, if any
    runner: ModelRunner | None = None


def run_workload(model: LlamaForCausalLM, waves: list[Wave], *, mode: str, max_tokens: int | dict[int, int],
                 page_size: int = 4, backend: AttentionBackend | None = None,
                 prefill_cost: CostModel | None = None, kv_tokens: int = 4096,
                 chunked_prefill_tokens: int = 8192, graph_max_batch: int = 0,
                 long_prefix_tokens: int | None = None,
                 modular: dict[int, tuple[list[ModuleSpan], list[tuple[int, int]]]] | None = None,
                 small_extend_rows: int | None = None, arrive_every: int | None = None) -> Result:
    """``graph_max_batch`` > 0: decode steps through ``DecodeGraphs`` (Triton backend; eager on the CPU).
    ``max_tokens``: for every request, or per rid. ``modular``: rid -> (module spans, rope runs) of the
    requests whose prompt is modular (``Scheduler.add_request``). ``small_extend_rows``: extend tokens a
    step may run as decode-graph rows (None: the runner's default; 0: never). ``arrive_every``: the next
    wave arrives this many steps after the previous one (requests join and leave a running batch); None:
    once the previous one has finished."""
    cfg = model.config
    dtype = next(model.parameters()).dtype
    sched_cfg = SchedulerConfig(kv_cache_tokens=kv_tokens, page_size=page_size,
                                chunked_prefill_tokens=chunked_prefill_tokens)
    sched = Scheduler(sched_cfg)
    planner = make_cascade_planner(mode, page_size)
    sched.set_cascade_planner(planner)
    kv = KVCache(num_layers=cfg.num_layers, num_pages=sched_cfg.num_pages + 1, page_size=page_size,
                 num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=dtype,
                 device=next(model.parameters()).device)
    if prefill_cost is None:
        prefill_cost = cost_model(mode)
    backend = backend or TorchBackend()
    graphs = None
    if graph_max_batch:
        from radixrelay.worker.cuda_graphs import DecodeGraphs

        graphs = DecodeGraphs(model, kv, backend, max_batch=graph_max_batch,
                              max_pages=sched_cfg.num_pages, scratch_slot=sched_cfg.num_pages * page_size)
    runner = ModelRunner(model, kv, backend, prefill_cost=prefill_cost, graphs=graphs,
                         split_long_prefixes=long_prefix_tokens is not None)
    if long_prefix_tokens is not None:           # short extends after this many cached tokens: split reads
        runner.long_prefix_tokens = long_prefix_tokens
    if small_extend_rows is not None:
        runner.small_extend_rows = small_extend_rows
    runner.sampler = recorder = RecordingSampler(runner.sampler)
    result = Result(planner=planner, graphs=graphs, runner=runner)
    pending = list(waves)
    since = 0                                   # steps since the last wave arrived
    while pending or sched.has_work():
        if pending and (not sched.has_work() or (arrive_every is not None and since >= arrive_every)):
            for rid, prompt in pending.pop(0):
                limit = max_tokens if isinstance(max_tokens, int) else max_tokens[rid]
                spans, rope_runs = (modular or {}).get(rid, (None, None))
                sched.add_request(rid, prompt, SamplingParams(max_tokens=limit, temperature=0, ignore_eos=True),
                                  modules=spans, rope_runs=rope_runs)
            since = 0
        plan = sched.schedule()
        assert plan is not None
        since += 1
        out = runner.step(plan)
        assert out.error is None, out.error
        result.plans.append(plan)
        result.logits.append(dict(zip(out.rids, recorder.last)) if out.rids else {})
        recorder.last = None
        for update in sched.process_output(out):
            result.tokens.setdefault(update.rid, []).extend(update.token_ids)
        sched.check_integrity()
    return result
