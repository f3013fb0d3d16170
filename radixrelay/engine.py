"""``Engine``: the offline API. One process runs tokenizer, scheduler and worker in a loop.

    with Engine(model="default") as engine:
        outs = engine.generate(["prompt", ...], SamplingParams(max_tokens=32, temperature=0))

Each step is ``plan = scheduler.schedule(); out = runner.step(plan);
updates = scheduler.process_output(out)``; the updates are detokenized per request here. The
scheduler and the model runner are the same objects the server drives.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from radixrelay.attention import KVCache, TorchBackend
from radixrelay.config import EngineConfig
from radixrelay.model.loader import load_model
from radixrelay.model.registry import resolve_model_path
from radixrelay.outputs import RequestOutput
from radixrelay.sampling_params import SamplingParams
from radixrelay.scheduler.config import SchedulerConfig
from radixrelay.scheduler.request import RequestUpdate
from radixrelay.scheduler.scheduler import Scheduler
from radixrelay.server.detokenizer import IncrementalDetokenizer
from radixrelay.server.tokenizer import Tokenizer, load_tokenizer
from radixrelay.worker.model_runner import ModelRunner
from radixrelay.worker.protocol import TokenLogprobs

Prompt = str | Sequence[int]
DEFAULT_CPU_KV_TOKENS = 32_768
CUDA_KV_MEMORY_FRACTION = 0.85   # of the memory free after the model is loaded


class _Tracker:
    """Per-request output state: emitted tokens, their text, logprobs."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens,
                                            context_ids=prompt_ids)
        self.want_logprobs = params.logprobs is not None
        self.sampled_logprobs: list[TokenLogprobs] = []
        self.token_ids: list[int] = []
        self.text = ""
        self.output: RequestOutput | None = None

    def apply(self, update: RequestUpdate) -> str:
        """Fold one scheduler update in; returns the new text."""
        self.token_ids.extend(update.token_ids)
        delta = self.detok.add(update.token_ids)
        if update.finished:
            delta += self.detok.finish()
            if update.trim_chars:
                full = self.text + delta
                full = full[: max(len(self.text), len(full) - update.trim_chars)]
                delta = full[len(self.text):]
        self.text += delta
        if update.finished:
            logprobs = self.sampled_logprobs[: len(self.token_ids)] if self.want_logprobs else None
            self.output = RequestOutput(self.text, list(self.token_ids), update.finish_reason or "abort",
                                        update.prompt_tokens, update.cached_tokens,
                                        update.completion_tokens, logprobs, update.error)
        return delta


class Engine:
    def __init__(self, model: str = "default", **options: Any) -> None:
        self.config = EngineConfig(model=model, **options)
        cfg = self.config
        device = torch.device(_pick_device(cfg.device))
        dtype = None if cfg.dtype == "auto" else getattr(torch, cfg.dtype)
        path = resolve_model_path(cfg.model)
        self.tokenizer = load_tokenizer(path)
        self.model, self.model_config = load_model(cfg.model, device=device, dtype=dtype,
                                                   load_format=cfg.load_format, seed=cfg.seed)
        mc = self.model_config
        kv_dtype = next(self.model.parameters()).dtype
        kv_tokens = cfg.kv_cache_tokens or _default_kv_tokens(device, mc, kv_dtype)
        num_pages = kv_tokens // cfg.page_size
        self.kv_cache = KVCache(num_layers=mc.num_layers, num_pages=num_pages, page_size=cfg.page_size,
                                num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, dtype=kv_dtype,
                                device=device)
        eos = tuple(sorted(self.tokenizer.eos_token_ids | set(mc.eos_token_ids)))
        self.scheduler = Scheduler(
            SchedulerConfig(kv_cache_tokens=num_pages * cfg.page_size, page_size=cfg.page_size,
                            max_running_requests=cfg.max_running_requests,
                            chunked_prefill_tokens=cfg.chunked_prefill_tokens,
                            schedule_policy=cfg.schedule_policy,
                            disable_radix_cache=cfg.disable_radix_cache, eos_token_ids=eos),
            detokenize=self.tokenizer.decode)
        self.runner = ModelRunner(self.model, self.kv_cache, TorchBackend(), seed=cfg.seed)
        self._rids = itertools.count()
        self._trackers: dict[int, _Tracker] = {}
        self.max_context = mc.max_position_embeddings
        self.steps = 0
        self.computed_tokens = 0   # tokens run through the model (cache hits excluded)

    # -- public API ----------------------------------------------------------------------------

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, cache_salt: str | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order. A prompt is text or token ids."""
        prompt_list = _as_prompt_list(prompts)
        params = _params_for(prompt_list, sampling_params)
        rids = [self._add(p, sp, cache_salt) for p, sp in zip(prompt_list, params)]
        while any(self._trackers[rid].output is None for rid in rids):
            self._step()
        return [self._trackers.pop(rid).output for rid in rids]

    def generate_stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                        *, cache_salt: str | None = None) -> Iterator[str]:
        """Yield text deltas of one request as they are produced."""
        rid = self._add(prompt, sampling_params or SamplingParams(), cache_salt)
        tracker = self._trackers[rid]
        try:
            while tracker.output is None:
                for update_rid, delta in self._step():
                    if update_rid == rid and delta:
                        yield delta
        finally:
            if tracker.output is None:
                self.abort(rid)
            self._trackers.pop(rid, None)

    def abort(self, rid: int) -> None:
        update = self.scheduler.abort(rid)
        if update is not None and rid in self._trackers:
            self._trackers[rid].apply(update)

    def stats(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self.config),
                **{f: getattr(self.scheduler.stats(), f) for f in self.scheduler.stats().__struct_fields__},
                "steps": self.steps, "computed_tokens": self.computed_tokens}

    def close(self) -> None:
        for rid in list(self._trackers):
            self.abort(rid)
        self._trackers.clear()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------------

    def _add(self, prompt: Prompt, params: SamplingParams, cache_salt: str | None) -> int:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids out of range [0, {self.model_config.vocab_size}): {bad[:5]}")
        if not ids:
            raise ValueError("empty prompt")
        if len(ids) + params.max_tokens > self.max_context:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                             f"model's context of {self.max_context} tokens")
        rid = next(self._rids)
        self.scheduler.add_request(rid, ids, params, cache_salt)
        self._trackers[rid] = _Tracker(self.tokenizer, ids, params)
        return rid

    def _step(self) -> list[tuple[int, str]]:
        plan = self.scheduler.schedule()
        if plan is None:
            if not self.scheduler.has_work():
                raise RuntimeError("engine idle with unfinished requests")
            raise RuntimeError("scheduler made no progress: no request fits the KV cache")
        self.computed_tokens += sum(e.num_tokens for e in plan.extends) + len(plan.decodes)
        out = self.runner.step(plan)
        self.steps += 1
        if out.logprobs is not None:
            for rid, lp in zip(out.rids, out.logprobs):
                tracker = self._trackers.get(rid)
                if tracker is not None and lp is not None:
                    tracker.sampled_logprobs.append(lp)
        deltas = []
        for update in self.scheduler.process_output(out):
            tracker = self._trackers.get(update.rid)
            if tracker is not None:
                deltas.append((update.rid, tracker.apply(update)))
        return deltas


def _pick_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return device


def _default_kv_tokens(device: torch.device, mc: Any, dtype: torch.dtype) -> int:
    if device.type != "cuda":
        return DEFAULT_CPU_KV_TOKENS
    free, _ = torch.cuda.mem_get_info(device)
    per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * dtype.itemsize
    return int(free * CUDA_KV_MEMORY_FRACTION) // per_token


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]                # one prompt given as token ids
    return items


def _params_for(prompts: list[Prompt],
                params: SamplingParams | Sequence[SamplingParams] | None) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * len(prompts)
    if isinstance(params, SamplingParams):
        return [params] * len(prompts)
    params = list(params)
    if len(params) != len(prompts):
        raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
    return params
