"""``Engine``: the offline API, driving the same scheduler and worker processes as the server.

    with Engine(model="default") as engine:
        outs = engine.generate(["prompt", ...], SamplingParams(max_tokens=32, temperature=0))

Prompt modules (``radixrelay.modules``, opt-in): ``engine.register_schema(pml)`` registers a schema;
``engine.generate(prompts, params, prompt_schema=name)`` then takes prompts written against it (PML
text, a JSON-style dict, or a ``modules.Prompt``), served from the modules' cached KV.

Pinned prefixes and priority (``generate``/``generate_stream`` keywords): ``pin_ttl_s`` keeps each prompt's
first ``pin_tokens`` tokens (all of it by default; whole pages) in the radix cache, unevicted, until that many
seconds pass without a request using them (``radixrelay.scheduler.pins``, within ``pinned_kv_tokens``);
``priority`` (smaller first, with ``enable_priority=True``) orders admission and retraction.

The Engine is a frontend like the HTTP server: its prompts take the server's admission path
(``radixrelay.admission``: encoding or checking token ids, context fitting, truncation; a refusal is
an ``AdmissionError``, a ``ValueError`` with the message the server's 400 carries), it submits them to
the scheduler process over ZMQ (``SyncRuntimeClient``, ids packed), and detokenizes the token updates
that come back incrementally, each token once (``OutputAssembler``). Leaving the ``with`` block (or
``close()``) stops the child processes.
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from radixrelay import modules
from radixrelay.admission import Admission, Budget, Limits
from radixrelay.config import EngineConfig
from radixrelay.model.model_registry import check_tokenizer_vocab, tokenizer_path
from radixrelay.modules.compose import ComposedPrompt
from radixrelay.modules.registry import SchemaInfo, SchemaRegistry
from radixrelay.outputs import RequestOutput
from radixrelay.protocol.messages import PinSpec, RequestRejected, UpdateBatch
from radixrelay.protocol.stats import stats_values
from radixrelay.radix.truncation import Truncated, Truncation
from radixrelay.runtime.client import QueueFullError
from radixrelay.runtime.sync_client import SyncRuntimeClient
from radixrelay.sampling_params import SamplingParams
from radixrelay.structured.grammar import GrammarEngine
from radixrelay.text.output_text import OutputAssembler
from radixrelay.text.tokenizer import load_tokenizer

Prompt = str | Sequence[int] | np.ndarray
SchemaPrompt = str | dict | modules.Prompt


class Engine:
    def __init__(self, model: str = "default", **options: Any) -> None:
        self.config = EngineConfig(model=model, **options)
        # The tokenizer loads on a thread while the runtime's processes start (seconds each).
        with ThreadPoolExecutor(1, thread_name_prefix="radixrelay-tokenizer") as pool:
            tokenizer = pool.submit(load_tokenizer, tokenizer_path(self.config))
            try:
                self._client = SyncRuntimeClient(self.config)
            except BaseException:
                if (error := tokenizer.exception()) is not None:    # the runtime failed on it too: its own error
                    raise error from None
                raise
        # Stops the children even if the caller never closes the engine.
        self._finalizer = weakref.finalize(self, self._client.close)
        try:
            self.tokenizer = tokenizer.result()
            check_tokenizer_vocab(self.config, self.tokenizer.vocab_size, self._client.info.vocab_size)
        except BaseException:
            self._finalizer()
            raise
        self.max_context = self._client.info.max_context
        self.vocab_size = self._client.info.vocab_size
        self.kv_cache_tokens = self._client.info.kv_cache_tokens
        truncation = (None if self.config.truncation is None else
                      Truncation(self.config.truncation, self.max_context, self.config.page_size))
        self._admission = Admission(self.tokenizer, Limits(self.max_context, self.kv_cache_tokens, self.vocab_size,
                                                           truncation))
        self._rids = itertools.count()
        self._outputs: dict[int, OutputAssembler] = {}
        self._grammars: GrammarEngine | None = None     # built on the first structured output
        self._schemas: SchemaRegistry | None = None     # built on the first registered schema

    # -- public API ----------------------------------------------------------------------------

    def register_schema(self, schema: str | modules.Schema) -> SchemaInfo:
        """Register a PML schema (text or ``modules.Schema``) for ``prompt_schema`` prompts; raises
        ``modules.SchemaError`` when it is invalid. The same name again replaces it."""
        return self.schemas.register(schema)

    @property
    def schemas(self) -> SchemaRegistry:
        """The registered prompt schemas (``radixrelay.modules.registry``)."""
        if self._schemas is None:
            self._schemas = SchemaRegistry.for_tokenizer(self.tokenizer, model_id=self.config.model,
                                                         page_size=self.config.page_size)
        return self._schemas

    def generate(self, prompts: Prompt | SchemaPrompt | Sequence[Prompt | SchemaPrompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, cache_salt: str | None = None, prompt_schema: str | None = None,
                 pin_ttl_s: float | None = None, pin_tokens: int | None = None,
                 priority: int = 0) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order. A prompt is text or token ids; with
        ``prompt_schema`` (a registered schema's name) a PML prompt, a dict or a ``modules.Prompt``.
        ``pin_ttl_s``, ``pin_tokens``, ``priority``: see the module docstring (a refusal is a ValueError)."""
        extra = _extra(pin_ttl_s, pin_tokens, priority)
        if prompt_schema is not None:
            prompt_list = list(prompts) if isinstance(prompts, (list, tuple)) else [prompts]
        else:
            prompt_list = _as_prompt_list(prompts)
        params = _params_for(prompt_list, sampling_params)
        self._check_params(params)
        rids: list[int] = []
        try:
            # Each prompt is submitted as soon as it is encoded: the scheduler admits (and the device
            # prefills) the first ones while later ones are still being checked. A bad prompt raises
            # here and the ones submitted before it are aborted below: nothing of the call stays live.
            for prompt, sp in zip(prompt_list, params):
                rids.append(self._submit(self._encode(prompt, sp, prompt_schema, cache_salt), sp, cache_salt,
                                         **extra))
            while not all(self._outputs[rid].finished for rid in rids):
                self._pump()
        except BaseException:
            for rid in rids:
                self.abort(rid)
            raise
        return [self._outputs.pop(rid).result() for rid in rids]

    def generate_stream(self, prompt: Prompt | SchemaPrompt, sampling_params: SamplingParams | None = None,
                        *, cache_salt: str | None = None, prompt_schema: str | None = None,
                        pin_ttl_s: float | None = None, pin_tokens: int | None = None,
                        priority: int = 0) -> Iterator[str]:
        """Yield text deltas of one request as they are produced."""
        params = sampling_params or SamplingParams()
        self._check_params([params])
        rid = self._submit(self._encode(prompt, params, prompt_schema, cache_salt), params, cache_salt,
                           **_extra(pin_ttl_s, pin_tokens, priority))
        output = self._outputs[rid]
        try:
            while not output.finished:
                for update_rid, delta in self._pump():
                    if update_rid == rid and delta:
                        yield delta
        finally:
            if not output.finished:
                self.abort(rid)
            self._outputs.pop(rid, None)

    def abort(self, rid: int) -> None:
        """Abort a request of this engine; its KV is freed before the scheduler's next step."""
        if self._outputs.pop(rid, None) is not None:
            self._client.abort(rid)

    def stats(self) -> dict[str, Any]:
        """The engine's configuration and every counter and gauge of the runtime
        (``radixrelay.protocol.stats``: one key per field, the same values as ``/metrics``), with a few
        derived ones."""
        stats = self._client.stats()
        worker_gc, scheduler_gc = stats.worker.gc, stats.loop.gc
        return {**dataclasses.asdict(self.config), **stats_values(stats),
                "worker_gc_s": worker_gc.seconds, "scheduler_gc_s": scheduler_gc.seconds,
                "gc_full_collections": worker_gc.full_collections + scheduler_gc.full_collections,
                "gc_longest_pause_s": max(worker_gc.longest_s, scheduler_gc.longest_s),
                # no live request and nothing held for one (``radixrelay.scheduler.audit``)
                "kv_idle_baseline": stats.kv_audit is not None and stats.kv_audit.at_idle_baseline,
                # per tensor-parallel rank (none at tp=1)
                **{f"rank{r}_device_s": s for r, s in enumerate(stats.worker.rank_device_s)}}

    @property
    def computed_tokens(self) -> int:
        """Tokens run through the model so far (prefix-cache hits excluded)."""
        return self._client.stats().loop.computed_tokens

    def flush_cache(self) -> bool:
        """Empty the radix cache; False (nothing done) while requests are live."""
        return self._client.flush_cache()

    def close(self) -> None:
        self._outputs.clear()
        self._finalizer()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------------

    def _check_params(self, params: Sequence[SamplingParams]) -> None:
        """What ``SamplingParams`` cannot check alone, before anything is submitted: stop token ids
        and ``logit_bias`` ids within the vocabulary (``ValueError``), and each structured output compiled
        once here (cached): a bad one raises ``InvalidStructuredOutput`` (a ValueError)."""
        for sp in params:
            if any(t >= self.vocab_size for t in sp.stop_token_ids):
                raise ValueError(f"SamplingParams.stop_token_ids: must be in [0, {self.vocab_size}) (the model's "
                                 f"vocabulary), got {max(sp.stop_token_ids)}")
            if any(t >= self.vocab_size for t, _ in sp.logit_bias):
                raise ValueError(f"SamplingParams.logit_bias: token ids must be in [0, {self.vocab_size}) (the "
                                 f"model's vocabulary), got {max(t for t, _ in sp.logit_bias)}")
        for spec in {p.structured for p in params if p.structured is not None}:
            if self._grammars is None:
                self._grammars = GrammarEngine(self.tokenizer, self.vocab_size)
            self._grammars.compile(spec)

    def _encode(self, prompt: Prompt | SchemaPrompt, params: SamplingParams, prompt_schema: str | None = None,
                cache_salt: str | None = None) -> Truncated | ComposedPrompt:
        """``prompt`` admitted (``radixrelay.admission``): text encoded, token ids checked, either fitted to the
        context with ``params.max_tokens`` (truncated on overflow with ``truncation`` set); a prompt against
        ``prompt_schema`` composed from its modules (no truncation: its positions are the schema's)."""
        budget = Budget(params.max_tokens)
        if prompt_schema is not None:
            composed = self.schemas.compose(prompt_schema, prompt, salt=cache_salt)
            self._admission.composed(composed, budget)
            return composed
        if isinstance(prompt, str):
            return self._admission.text(prompt, budget).prompt
        return self._admission.token_ids(prompt, budget).prompt          # type: ignore[arg-type]

    def _submit(self, prompt: Truncated | ComposedPrompt, params: SamplingParams, cache_salt: str | None,
                pin: tuple[int | None, float] | None = None, priority: int = 0) -> int:
        """``pin``: (prompt tokens to pin, None for all; TTL seconds)."""
        rid = next(self._rids)
        ids = prompt.token_ids if isinstance(prompt, ComposedPrompt) else prompt.ids
        pins = [] if pin is None else [PinSpec(len(ids) if pin[0] is None else pin[0], pin[1])]
        if isinstance(prompt, ComposedPrompt):
            self._outputs[rid] = OutputAssembler(self.tokenizer, prompt.token_ids, params)
            self._client.submit(rid, prompt.token_ids, params, cache_salt, modules=prompt.modules,
                                rope_runs=prompt.rope_runs, pins=pins, priority=priority)
            return rid
        self._outputs[rid] = OutputAssembler(self.tokenizer, prompt.ids, params)
        self._client.submit(rid, prompt.ids, params, cache_salt, prompt.shifted_prefix, prompt.shifted_at,
                            pins=pins, priority=priority)
        return rid

    def _pump(self) -> list[tuple[int, str]]:
        """Handle the next scheduler message; returns the text deltas it produced."""
        message = self._client.recv()
        if isinstance(message, RequestRejected):
            if self._outputs.pop(message.rid, None) is None:
                return []
            error = QueueFullError if message.reason == "queue_full" else ValueError
            raise error(message.message)
        if not isinstance(message, UpdateBatch):
            raise RuntimeError(f"unexpected runtime message {type(message).__name__}")
        deltas = []
        for item in message.items:
            output = self._outputs.get(item.update.rid)
            if output is not None:
                deltas.append((item.update.rid, output.apply(item)))
        return deltas


def _extra(pin_ttl_s: float | None, pin_tokens: int | None, priority: int) -> dict[str, Any]:
    """``_submit``'s pin and priority keywords from the public ones."""
    if pin_tokens is not None and pin_ttl_s is None:
        raise ValueError("pin_tokens needs pin_ttl_s (how long the prefix stays pinned)")
    return {"pin": None if pin_ttl_s is None else (pin_tokens, pin_ttl_s), "priority": priority}


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (text; token ids: a 1-D array, or a sequence whose first item is an integer) or several."""
    if isinstance(prompts, str) or (isinstance(prompts, np.ndarray) and prompts.ndim == 1):
        return [prompts]
    items = list(prompts)
    if items and isinstance(items[0], (int, np.integer)) and not isinstance(items[0], bool):
        return [items]                # one prompt given as token ids (checked whole by admission)
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
