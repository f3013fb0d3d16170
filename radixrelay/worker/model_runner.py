"""Worker side of a step: the request table, the model, the KV memory and the sampler.

HOT FILE: only what runs every step belongs here (apply the plan diff, pack the batch, forward,
sample). Loading lives in ``radixrelay.model.loader``, batch packing in
``radixrelay.attention.metadata``, sampling in ``radixrelay.worker.sampling``.

The request table mirrors the scheduler's view (``protocol.py`` states the invariants): for every
resident request, its tokens (prompt + everything sampled so far) and its page list. A decode
computes the request's last known token, whose position is ``len(tokens) - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixrelay.attention import AttentionBackend, KVCache
from radixrelay.attention.metadata import BatchRequest, build_forward_batch
from radixrelay.model.llama import LlamaForCausalLM
from radixrelay.sampling_params import SamplingParams
from radixrelay.worker.protocol import StepOutput, StepPlan
from radixrelay.worker.sampling import Sampler, SamplingTensors


@dataclass
class _Resident:
    token_ids: list[int]
    num_prompt_tokens: int
    pages: list[int]
    sampling: SamplingParams


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, backend: AttentionBackend,
                 *, seed: int = 0) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.page_size = kv_cache.page_size
        self.device = kv_cache.device
        self.vocab_size = model.config.vocab_size
        generator = torch.Generator(device=self.device).manual_seed(seed)
        self.sampler = Sampler(generator)
        self._table: dict[int, _Resident] = {}

    @property
    def num_resident(self) -> int:
        return len(self._table)

    def step(self, plan: StepPlan) -> StepOutput:
        """Apply the plan's diff, compute its extends and decodes, sample where asked. A failure
        comes back as ``StepOutput.error`` (the request table is left as the plan made it)."""
        try:
            self._apply_diff(plan)
            return self._compute(plan)
        except Exception as exc:  # noqa: BLE001 - the scheduler turns this into request errors
            return StepOutput(plan.step_id, [], [], error=f"{type(exc).__name__}: {exc}")

    def _apply_diff(self, plan: StepPlan) -> None:
        for rid in plan.released:
            self._table.pop(rid, None)
        for req in plan.admitted:
            self._table[req.rid] = _Resident(list(req.token_ids), req.num_prompt_tokens,
                                             list(req.pages), req.sampling)
        for append in plan.page_appends:
            self._table[append.rid].pages.extend(append.pages)

    def _compute(self, plan: StepPlan) -> StepOutput:
        # Rows of the flat batch: every extend chunk, then every decode (one token each).
        work: list[BatchRequest] = []
        input_ids: list[int] = []
        samplers: list[int] = []
        for item in plan.extends:
            res = self._table[item.rid]
            input_ids.extend(res.token_ids[item.start:item.start + item.num_tokens])
            work.append(BatchRequest(res.pages, item.start, item.num_tokens, need_logits=item.sample))
            if item.sample:
                samplers.append(item.rid)
        for rid in plan.decodes:
            res = self._table[rid]
            input_ids.append(res.token_ids[-1])
            work.append(BatchRequest(res.pages, len(res.token_ids) - 1, 1))
            samplers.append(rid)
        if not work:
            return StepOutput(plan.step_id, [], [])

        batch = build_forward_batch(work, self.page_size, self.device)
        ids = torch.tensor(input_ids, dtype=torch.int64).to(self.device, non_blocking=True)
        logits = self.model(ids, batch, self.kv_cache, self.backend)       # [len(samplers), V]
        if not samplers:
            return StepOutput(plan.step_id, [], [])

        residents = [self._table[rid] for rid in samplers]
        tensors = SamplingTensors.build(
            [r.sampling for r in residents], [r.token_ids for r in residents],
            [r.num_prompt_tokens for r in residents], vocab_size=logits.shape[-1], device=self.device)
        out = self.sampler(logits.float(), tensors)
        token_ids = out.token_ids.tolist()
        for res, token in zip(residents, token_ids):
            res.token_ids.append(token)
        logprobs = None if out.logprobs is None else out.logprobs.to_protocol(tensors.num_logprobs)
        return StepOutput(plan.step_id, samplers, token_ids, logprobs)
