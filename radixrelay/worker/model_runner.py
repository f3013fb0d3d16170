"""Worker side of a step: the request table, the model, the KV memory and the sampler.

HOT FILE: only what runs every step belongs here (apply the plan diff, pack the batch, forward,
sample). Loading lives in ``radixrelay.model.loader``, batch packing in
``radixrelay.attention.metadata``, sampling in ``radixrelay.worker.sampling``, prompt logprobs in
``radixrelay.worker.prompt_logprobs``.

The request table mirrors the scheduler's view (``protocol.py`` states the invariants): for every
resident request, its tokens (prompt + everything sampled so far) and its page list. A decode
computes the request's last known token, whose position is ``len(tokens) - 1``.

Cascade: ``StepPlan.cascade`` (decode groups) and, with ``prefill_cost``, the extend rows' shared
cached pages become the batch's ``CascadeBatch`` (``radixrelay.cascade.batch``); the backend executes it.
"""

from __future__ import annotations

import time

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixrelay.attention import AttentionBackend, KVCache
from radixrelay.attention.metadata import (BatchRequest, DevicePageTable, ForwardBatch, build_forward_batch,
                                           build_shared_runs)
from radixrelay.cascade.batch import DecodeRunsCache, prefill_runs
from radixrelay.cascade.cost import CostModel
from radixrelay.model.llama import LlamaForCausalLM
from radixrelay.sampling_params import SamplingParams
from radixrelay.worker.prompt_logprobs import num_logits_rows, prompt_logprobs_chunk
from radixrelay.worker.protocol import ExtendItem, PromptLogprobsChunk, StepOutput, StepPlan
from radixrelay.worker.sampling import Sampler, SamplingTensors

if TYPE_CHECKING:   # cuda_graphs imports the Triton kernels; a torch-only worker never loads them
    from radixrelay.worker.cuda_graphs import DecodeGraphs


@dataclass
class _Resident:
    token_ids: list[int]
    num_prompt_tokens: int
    pages: list[int]
    sampling: SamplingParams


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, backend: AttentionBackend,
                 *, seed: int = 0, prefill_cost: CostModel | None = None,
                 graphs: DecodeGraphs | None = None) -> None:
        """``prefill_cost``: share cached runs of KV between extend rows when it says so (None: never);
        ``graphs``: run the decode-only steps that fit it as CUDA graphs (same model, cache, backend)."""
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.page_size = kv_cache.page_size
        self.device = kv_cache.device
        self.vocab_size = model.config.vocab_size
        generator = torch.Generator(device=self.device).manual_seed(seed)
        self.sampler = Sampler(generator)
        self._table: dict[int, _Resident] = {}
        self._page_table = DevicePageTable(self.device)      # the same page lists, on the device
        self.prefill_cost = prefill_cost
        self._decode_runs = DecodeRunsCache(self.page_size, self.device, backend.splits_shared_pages(self.device))
        self.graphs = graphs
        self.last_launch_s = 0.0     # the last step's host time until the model's kernels were launched

    @property
    def num_resident(self) -> int:
        return len(self._table)

    def step(self, plan: StepPlan) -> StepOutput:
        """Apply the plan's diff, compute its extends and decodes, sample where asked. A failure
        comes back as ``StepOutput.error`` (the request table is left as the plan made it)."""
        self._step_start = time.perf_counter()
        self.last_launch_s = 0.0
        try:
            self._apply_diff(plan)
            return self._compute(plan)
        except Exception as exc:  # noqa: BLE001 - the scheduler turns this into request errors
            return StepOutput(plan.step_id, [], [], error=f"{type(exc).__name__}: {exc}")

    def _apply_diff(self, plan: StepPlan) -> None:
        for rid in plan.released:
            if self._table.pop(rid, None) is not None:
                self._page_table.release(rid)
        for req in plan.admitted:
            self._table[req.rid] = _Resident(list(req.token_ids), req.num_prompt_tokens,
                                             list(req.pages), req.sampling)
            self._page_table.admit(req.rid, req.pages)
        for append in plan.page_appends:
            self._table[append.rid].pages.extend(append.pages)
            self._page_table.append(append.rid, append.pages)

    def _compute(self, plan: StepPlan) -> StepOutput:
        # Rows of the flat batch: every extend chunk, then every decode (one token each). Logits
        # rows: per extend its prompt-logprobs run (if any), then its sampling row; one per decode.
        work: list[BatchRequest] = []
        input_ids: list[int] = []
        samplers: list[int] = []
        sample_rows: list[int] = []                       # logits row of each sampler
        owed: list[tuple[ExtendItem, int]] = []           # (extend, its first logits row)
        num_rows = 0
        for item in plan.extends:
            res = self._table[item.rid]
            input_ids.extend(res.token_ids[item.start:item.start + item.num_tokens])
            num_logits = num_logits_rows(item)
            work.append(BatchRequest(res.pages, item.start, item.num_tokens, num_logits))
            if item.num_prompt_logprobs:
                owed.append((item, num_rows))
            num_rows += num_logits
            if item.sample:
                samplers.append(item.rid)
                sample_rows.append(num_rows - 1)
        for rid in plan.decodes:
            res = self._table[rid]
            input_ids.append(res.token_ids[-1])
            work.append(BatchRequest(res.pages, len(res.token_ids) - 1, 1))
            samplers.append(rid)
            sample_rows.append(num_rows)
            num_rows += 1
        if not work:
            return StepOutput(plan.step_id, [], [])

        batch = self._batch(plan, work)
        ids = torch.tensor(input_ids, dtype=torch.int64).to(self.device, non_blocking=True)
        if self.graphs is not None and self.graphs.fits(batch):
            logits = self.graphs.run(ids, batch)                             # [num_rows, V]
        else:
            logits = self.model(ids, batch, self.kv_cache, self.backend)
        self.last_launch_s = time.perf_counter() - self._step_start      # the device may still be busy
        prompt_chunks = [self._prompt_logprobs(item, logits[row:row + item.num_prompt_logprobs])
                         for item, row in owed]
        if not samplers:
            return StepOutput(plan.step_id, [], [], prompt_logprobs=prompt_chunks)
        if owed:                                                             # -> [len(samplers), V]
            logits = logits.index_select(0, torch.tensor(sample_rows).to(self.device, non_blocking=True))

        residents = [self._table[rid] for rid in samplers]
        tensors = SamplingTensors.build(
            [r.sampling for r in residents], [r.token_ids for r in residents],
            [r.num_prompt_tokens for r in residents], vocab_size=logits.shape[-1], device=self.device)
        out = self.sampler(logits.float(), tensors)
        token_ids = out.token_ids.tolist()
        for res, token in zip(residents, token_ids):
            res.token_ids.append(token)
        logprobs = None if out.logprobs is None else out.logprobs.to_protocol(tensors.num_logprobs)
        return StepOutput(plan.step_id, samplers, token_ids, logprobs, prompt_chunks)

    def _prompt_logprobs(self, item: ExtendItem, logits: torch.Tensor) -> PromptLogprobsChunk:
        res = self._table[item.rid]
        k = res.sampling.prompt_logprobs
        if k is None:
            raise ValueError(f"request {item.rid}: prompt logprobs owed but not requested")
        return prompt_logprobs_chunk(item, logits, res.token_ids, k)

    def _batch(self, plan: StepPlan, work: list[BatchRequest]) -> ForwardBatch:
        num_extends = len(plan.extends)
        decode_shared = prefill_shared = None
        if plan.cascade is not None and plan.decodes:
            decode_shared = self._decode_runs.get(plan.cascade, plan.decodes, lambda rid: self._table[rid].pages)
        extend_start = [0] * num_extends
        if self.prefill_cost is not None and num_extends > 1:
            runs, extend_start = prefill_runs(work[:num_extends], self.prefill_cost, self.page_size)
            prefill_shared = build_shared_runs(runs, self.device)
        kv_start = None
        if decode_shared is not None or prefill_shared is not None:
            own = plan.cascade.own_start if decode_shared is not None else {}
            kv_start = extend_start + [own.get(rid, 0) for rid in plan.decodes]
        page_table = self._page_table.gather([item.rid for item in plan.extends] + plan.decodes)
        return build_forward_batch(work, self.page_size, self.device, page_table=page_table,
                                   num_decodes=len(plan.decodes),
                                   kv_start=kv_start, decode_runs=decode_shared, prefill_runs=prefill_shared)
