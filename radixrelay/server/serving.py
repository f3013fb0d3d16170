"""The OpenAI endpoints' logic: request -> choices on the runtime -> response or SSE stream.

One HTTP request becomes ``len(prompts) * n`` runtime requests ("choices"), run concurrently by a
``GenerationJob`` that merges their update streams. Choice ``i * n + j`` is sample ``j`` of prompt
``i``; with a ``seed``, sample ``j`` uses ``seed + j`` so that the n samples differ but repeat.

Completions with ``echo`` show the prompt before the output, and with ``logprobs`` also the prompt
tokens' logprobs (the runtime's prompt logprobs; ``null`` for the first token), as vLLM does:
``text_offset`` counts from the start of the echoed prompt. ``max_tokens: 0`` is allowed with
``echo``: one token is generated (and counted in ``usage``) but only the prompt is returned.

With ``prompt_schema`` (modular prompt reuse) a prompt is composed against a registered schema
(``radixrelay.modules.registry``): the choice serves ``ComposedPrompt.token_ids`` with its module
spans. Such a prompt is never truncated; it must fit the context both as positions
(``end_position + max_tokens``) and as KV (its tokens, page padding included, ``+ max_tokens``).
``usage.prompt_tokens`` counts all its tokens, the placeholder padding of module spans to whole
pages included (what the model processes; cached and module tokens never exceed it), and
``usage.prompt_tokens_details.module_padding_tokens`` says how many of them are padding; ``echo``
is refused.

A request's bulk work on its prompts (chat template rendering, tokenization, composing modular
prompts) runs in ``PromptWork``'s bounded thread pool, never on the event loop. Prompts are admitted
by ``radixrelay.admission``, the Engine's path too: text encoded with a bound (an over-long prompt
costs time and memory proportional to the context, not to the prompt), token ids checked in numpy,
both fitted to the context (max_tokens, truncation) as int32 arrays that reach the runtime client
packed; its ``AdmissionError``s are 400s naming their field.

Each request's host stages are timed (``Stages``) and added to the server's counters once
(``ServerMetrics.observe_stages``): ``parse`` (body read and JSON decode, in the app), ``render`` (the
chat template), ``tokenize`` (encoding or checking ids, fitting, composing), ``submit`` (from the
choices' hand-off to the runtime client until every one was sent).
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import numpy as np

from radixrelay.admission import Admission, AdmissionError, Admitted, Budget, Limits
from radixrelay.modules.compose import ComposedPrompt
from radixrelay.modules.pml import SchemaError
from radixrelay.modules.registry import SchemaRegistry, UnknownSchemaError
from radixrelay.radix.truncation import Truncated, Truncation
from radixrelay.runtime.async_client import AsyncRuntimeClient
from radixrelay.runtime.client import QueueFullError, RuntimeDiedError
from radixrelay.protocol.messages import PinSpec, TokenUpdate
from radixrelay.sampling_params import SamplingParams
from radixrelay.server import openai_protocol as oa
from radixrelay.server import prompt_pins
from radixrelay.server.prompt_pins import retention_pins
from radixrelay.text.chat_template import ChatTemplate
from radixrelay.server.prometheus_metrics import ServerMetrics
from radixrelay.text.output_text import OutputAssembler
from radixrelay.server.sse import DONE, EventStreamResponse, event
from radixrelay.server.grammar_check import GrammarCheck
from radixrelay.text.tokenizer import Tokenizer
from radixrelay.structured.spec import InvalidStructuredOutput, StructuredOutput
from radixrelay.protocol.step import TokenLogprobs
from radixrelay.text import reasoning, tool_calls
from radixrelay.text.chat_output import ChatOutput

T = TypeVar("T")
INLINE_SIZE = 4096          # prompt work up to this size (characters, ids / IDS_PER_UNIT) runs on the event loop
IDS_PER_UNIT = 64           # token ids checked (numpy) per unit of prompt work; a character encoded is one
Stages = dict[str, float]   # one request's host seconds by stage, added to the server's counters once


class PromptWork:
    """The thread pool requests' prompt work runs in: ``workers`` prompts are worked on at once,
    the others wait their turn off the event loop. Work of at most ``inline_size`` characters runs
    on the loop (less than a hand-off to a thread costs)."""

    def __init__(self, workers: int | None = None, inline_size: int = INLINE_SIZE) -> None:
        self.workers = workers or max(1, min(4, os.cpu_count() or 1))
        self.inline_size = inline_size
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="prompt-work")

    async def run(self, size: int, fn: Callable[[], T]) -> T:
        if size <= self.inline_size:
            return fn()
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)


@dataclass
class ServingContext:
    client: AsyncRuntimeClient
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None
    model_name: str
    max_n: int
    metrics: ServerMetrics
    # Most runtime requests (prompts x n) one HTTP request may make: more could never all be
    # admitted (running + queued), so they are a 400 rather than a 429 the client would retry.
    max_choices: int
    grammars: GrammarCheck
    truncation: Truncation | None = None    # context overflow drops the oldest tokens (else a 400)
    schemas: SchemaRegistry | None = None   # prompt modules (``prompt_schema``); None: refused
    prompt_work: PromptWork | None = None   # where prompt work runs (None: on the caller's thread)
    tool_call_parser: str = "auto"          # a ``tool_calls.FORMATS`` name; auto: from the chat template
    reasoning_parser: str = "auto"          # 'think' | 'none'; auto: 'think' if the template writes </think>
    admission: Admission = field(init=False)   # the runtime's limits, ``truncation``
    tool_format: tool_calls.CallFormat = field(init=False)
    marker_is_text: bool = field(init=False)   # the call marker is no special token (a grammar can write it)
    thinks: bool = field(init=False)           # outputs may start with a reasoning block

    def __post_init__(self) -> None:
        info = self.client.info
        self.admission = Admission(self.tokenizer, Limits(info.max_context, info.kv_cache_tokens,
                                                          info.vocab_size, self.truncation))
        template = self.chat_template.text if self.chat_template is not None else None
        self.tool_format = (tool_calls.detect_format(template) if self.tool_call_parser == "auto"
                            else tool_calls.get_format(self.tool_call_parser))
        marker = self.tool_format.marker
        self.marker_is_text = not marker or self.tokenizer.token_to_id(marker) not in self.tokenizer.special_token_ids
        self.thinks = (reasoning.template_thinks(template) if self.reasoning_parser == "auto"
                       else self.reasoning_parser != "none")

    async def run_prompt_work(self, size: int, fn: Callable[[], T]) -> T:
        return fn() if self.prompt_work is None else await self.prompt_work.run(size, fn)


@dataclass(eq=False)
class Choice:
    index: int
    prompt_index: int
    prompt_ids: np.ndarray | list[int]      # int32 [n] as admitted (a composed prompt's: a list)
    sampling: SamplingParams
    output: OutputAssembler
    echo: bool = False                    # completions: the prompt precedes the output
    echo_only: bool = False               # completions with max_tokens 0: the output is hidden
    shifted_prefix: list[int] | None = None  # a truncated prompt's (``radixrelay.radix.truncation``)
    shifted_at: int = 0
    composed: ComposedPrompt | None = None   # a ``prompt_schema`` prompt (``prompt_ids`` are its tokens)
    last_token_at: float | None = None
    chat: ChatOutput | None = None           # chat: reasoning and tool calls taken out of the output text
    pins: list[PinSpec] = field(default_factory=list)   # pinned prefixes of the prompt (``prompt_pins``)
    priority: int = 0                        # the request's (smaller first; the scheduler checks it is allowed)


@dataclass(frozen=True)
class Event:
    choice: Choice
    item: TokenUpdate
    delta: str


def api_error(exc: Exception) -> oa.APIError:
    """The HTTP error for an exception a generation ended with."""
    if isinstance(exc, oa.APIError):
        return exc
    if isinstance(exc, QueueFullError):
        return oa.APIError(429, str(exc), type="rate_limit_error", code="queue_full")
    if isinstance(exc, AdmissionError):
        return oa.invalid(str(exc), exc.param)
    if isinstance(exc, ValueError):
        return oa.invalid(str(exc))
    if isinstance(exc, RuntimeDiedError):
        return oa.APIError(503, str(exc), type="server_error", code="runtime_unavailable")
    return oa.APIError(500, f"{type(exc).__name__}: {exc}", type="server_error")


class GenerationJob:
    """The choices of one HTTP request, running concurrently; ``cancel`` aborts them all."""

    def __init__(self, ctx: ServingContext, choices: list[Choice], cache_salt: str | None,
                 started: float | None = None) -> None:
        """``started``: the request's arrival (``time.monotonic()``; TTFT counts from it), else now."""
        self.ctx = ctx
        self.choices = choices
        self.cache_salt = cache_salt
        self.started = time.monotonic() if started is None else started
        self._queue: asyncio.Queue[tuple[Choice, TokenUpdate | Exception]] = asyncio.Queue()
        self._unfinished = len(choices)
        self._unsent = len(choices)
        self._handed_off = time.perf_counter()
        self._tasks = [asyncio.create_task(self._pump(c)) for c in choices]

    def _sent(self) -> None:
        """One choice's request went out to the runtime; the last one ends the ``submit`` stage."""
        self._unsent -= 1
        if not self._unsent:
            self.ctx.metrics.observe_stages({"submit": time.perf_counter() - self._handed_off})

    async def _pump(self, choice: Choice) -> None:
        composed = choice.composed
        modular = {} if composed is None or not composed.is_modular else \
            {"modules": composed.modules, "rope_runs": composed.rope_runs}
        try:
            async for item in self.ctx.client.generate(choice.prompt_ids, choice.sampling,
                                                       cache_salt=self.cache_salt,
                                                       shifted_prefix=choice.shifted_prefix,
                                                       shifted_at=choice.shifted_at, on_sent=self._sent,
                                                       pins=choice.pins, priority=choice.priority, **modular):
                self._queue.put_nowait((choice, item))
        except Exception as exc:  # noqa: BLE001 - re-raised by next_event in the handler
            self._queue.put_nowait((choice, exc))

    async def next_event(self) -> Event | None:
        """The next update of any choice; None once every choice finished. Raises the error a
        choice failed with (rejection, runtime death, worker failure)."""
        if not self._unfinished:
            return None
        choice, item = await self._queue.get()
        if isinstance(item, Exception):
            raise item
        update = item.update
        if update.error is not None:
            if update.error_type == "invalid_request_error":      # the request's own fault: a 400
                raise oa.APIError(400, update.error, type="invalid_request_error", code="request_too_costly")
            raise RuntimeError(f"generation failed: {update.error}")
        delta = choice.output.apply(item)
        self._observe(choice, item)
        if update.finished:
            self._unfinished -= 1
        return Event(choice, item, delta)

    async def events(self) -> AsyncIterator[Event]:
        while (ev := await self.next_event()) is not None:
            yield ev

    def cancel(self) -> None:
        """Abort every unfinished choice (synchronous: safe from a cancelled task)."""
        for task in self._tasks:
            task.cancel()

    def _observe(self, choice: Choice, item: TokenUpdate) -> None:
        metrics, update = self.ctx.metrics, item.update
        now = time.monotonic()
        if update.token_ids:
            if choice.last_token_at is None:
                metrics.ttft.observe(now - self.started)
            else:   # tokens released together (held back for a stop string) share the gap
                gap = (now - choice.last_token_at) / len(update.token_ids)
                for _ in update.token_ids:
                    metrics.inter_token.observe(gap)
            choice.last_token_at = now
        if update.finished:
            metrics.requests.labels(update.finish_reason or "abort").inc()
            metrics.prompt_tokens.inc(update.prompt_tokens)
            metrics.generation_tokens.inc(update.completion_tokens)


def module_padding(composed: ComposedPrompt | None) -> int:
    """Placeholder tokens padding a modular prompt's module spans to whole pages."""
    if composed is None:
        return 0
    return sum(len(m.token_ids) - m.num_real for m in composed.modules)


def usage(choices: list[Choice]) -> oa.Usage:
    """Each prompt counts once (its first choice's numbers), every choice's completion counts."""
    firsts = {c.prompt_index: c for c in reversed(choices)}
    prompt = sum(len(c.prompt_ids) for c in firsts.values())
    cached = sum(c.output.last.cached_tokens for c in firsts.values() if c.output.last is not None)
    modules = sum(getattr(c.output.last, "module_tokens", 0) for c in firsts.values()
                  if c.output.last is not None)
    padding = sum(module_padding(c.composed) for c in firsts.values())
    completion = sum(c.output.last.completion_tokens for c in choices if c.output.last is not None)
    return oa.Usage(prompt, completion, prompt + completion,
                    oa.PromptTokensDetails(cached, modules, padding))


# -- request -> choices -------------------------------------------------------------------------


def _check_common(ctx: ServingContext, req: oa.GenerationRequest) -> None:
    if req.model != ctx.model_name:
        raise oa.invalid(f"model {req.model!r} does not exist; this server serves {ctx.model_name!r}",
                         "model")
    if not 1 <= req.n <= ctx.max_n:
        raise oa.invalid(f"n must be in [1, {ctx.max_n}], got {req.n}", "n")
    vocab = ctx.client.info.vocab_size
    if any(t >= vocab for t in req.stop_token_ids or ()):
        raise oa.invalid(f"stop_token_ids must be in [0, {vocab})", "stop_token_ids")
    if req.logit_bias and any(t >= vocab for t, _ in oa.logit_bias_pairs(req.logit_bias)):
        raise oa.invalid(f"logit_bias keys must be token ids in [0, {vocab})", "logit_bias")


async def check_structured(ctx: ServingContext, req: oa.GenerationRequest, choices: list[Choice]) -> None:
    """400 unless the request's output constraint compiles (once per distinct constraint)."""
    for spec in {c.sampling.structured for c in choices if c.sampling.structured is not None}:
        try:
            await ctx.grammars.check(spec)
        except InvalidStructuredOutput as exc:
            field_name = req.structured_field or "tools"     # no constraint of its own: its tools'
            raise oa.invalid(str(exc), field_name) from None


def _check_choices(ctx: ServingContext, num_prompts: int, n: int, param: str) -> None:
    if num_prompts * n > ctx.max_choices:
        raise oa.invalid(f"{num_prompts} prompt(s) x n={n} exceeds the {ctx.max_choices} generations "
                         "one request may ask for", param)


@contextmanager
def timed(stages: Stages, stage: str) -> Iterator[None]:
    """Adds the time of its block to ``stages[stage]`` (raised or not)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        stages[stage] = stages.get(stage, 0.0) + time.perf_counter() - start


def _registry(ctx: ServingContext) -> SchemaRegistry:
    if ctx.schemas is None:
        raise oa.invalid("prompt modules are not available on this server", "prompt_schema")
    return ctx.schemas


@contextmanager
def _schema_errors(param: str) -> Iterator[None]:
    """SchemaErrors as 400s: an unknown schema names ``prompt_schema``, anything wrong with the
    prompt (unknown module, a value past ``len``, ...) names ``param``."""
    try:
        yield
    except UnknownSchemaError as exc:
        raise oa.APIError(400, str(exc), param="prompt_schema", code="schema_not_found") from None
    except SchemaError as exc:
        raise oa.invalid(str(exc), param) from None


def _wrap_int64(value: int) -> int:
    """``value`` wrapped into the signed 64-bit range (sample j's seed ``seed + j`` past the largest seed)."""
    return (value + 2 ** 63) % 2 ** 64 - 2 ** 63


def _choices(ctx: ServingContext, req: oa.GenerationRequest, prompts: list[Truncated],
             max_tokens: list[int], logprobs: int | None, *, echo: bool = False,
             echo_only: bool = False, composed: list[ComposedPrompt] | None = None,
             output: OutputPlan | None = None, pins: list[list[PinSpec]] | None = None) -> list[Choice]:
    """``pins``: each prompt's ``cache_control`` pins (``prompt_pins``); ``prompt_cache_retention`` adds its own."""
    prompt_logprobs = logprobs if echo else None
    overrides = output.overrides if output is not None else None
    out = []
    for p, prompt in enumerate(prompts):
        ids = prompt.ids
        for j in range(req.n):
            seed = None if req.seed is None else _wrap_int64(req.seed + j)
            sp = oa.sampling_params(req, max_tokens=max_tokens[p], logprobs=logprobs, seed=seed,
                                    prompt_logprobs=prompt_logprobs, overrides=overrides)
            out.append(Choice(p * req.n + j, p, ids, sp, OutputAssembler(ctx.tokenizer, ids, sp),
                              echo, echo_only, shifted_prefix=prompt.shifted_prefix or None,
                              shifted_at=prompt.shifted_at, composed=composed[p] if composed else None,
                              chat=output.chat_output() if output is not None else None,
                              pins=(pins[p] if pins else []) + retention_pins(req.prompt_cache_retention, len(ids)),
                              priority=req.priority))
    return out


@dataclass(frozen=True)
class OutputPlan:
    """How a chat request's output is read (reasoning, tool calls) and what that asks of sampling."""

    thinks: bool                                  # split off a reasoning block
    opened: bool                                  # the prompt opened it
    calls: tool_calls.CallFormat | None           # read calls in this format (None: tool_choice none)
    forced: bool                                  # the output is calls from its first character
    overrides: dict[str, Any]                     # SamplingParams fields (the calls' structural tag)

    def chat_output(self) -> ChatOutput | None:
        if not self.thinks and self.calls is None:
            return None
        return ChatOutput(reasoning=self.thinks, opened=self.opened, calls=self.calls, forced=self.forced)


def _output_plan(ctx: ServingContext, req: oa.ChatCompletionRequest, tools: oa.ToolRequest,
                 prompt: str) -> OutputPlan:
    """Reasoning is split off when the template thinks (and ``separate_reasoning``); calls are read
    unless ``tool_choice`` is none, and constrained by a structural tag where the format allows (a
    forced call always; ``auto`` unless ``response_format`` constrains the output instead, or
    ``ignore_eos`` asks for an output no grammar may end)."""
    thinks = ctx.thinks and req.separate_reasoning
    opened = ctx.thinks and reasoning.prompt_opens_reasoning(prompt)
    overrides: dict[str, Any] = {}
    if tools.mode == "none":
        return OutputPlan(thinks, opened, None, False, overrides)
    fmt = ctx.tool_format
    given = req.structured_output()
    if tools.forced and given is not None:
        raise oa.invalid(f"{req.structured_field} cannot be combined with a forced tool_choice (the output "
                         "is the call)", req.structured_field)
    if given is None and not (req.ignore_eos and not tools.forced):     # (a grammar ends the output)
        tag = tool_calls.constraint(fmt, tools.functions, tools.mode, parallel=tools.parallel,
                                    marker_is_text=ctx.marker_is_text,
                                    open_reasoning=reasoning.CLOSE if opened else None)
        if tag is not None:
            try:
                overrides["structured"] = StructuredOutput.structural_tag(tag)
            except (ValueError, RecursionError) as exc:
                raise oa.invalid(f"tools: {exc}", "tools") from None
    if not ctx.marker_is_text and fmt.marker_needed:
        overrides["skip_special_tokens"] = False      # the call marker is a special token: keep it in the text
    forced = tools.forced and (thinks or not opened)     # calls from the first character of the content
    return OutputPlan(thinks, opened, fmt, forced, overrides)


def _chat_size(messages: list[Any]) -> int:
    """About how much prompt work ``messages`` make: their text's characters, plus one per message
    and per content part."""
    size = 0
    for message in messages:
        size += 1
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            size += len(content)
        elif isinstance(content, list):
            for part in content:
                size += 1
                text = part.get("text") if isinstance(part, dict) else None
                size += len(text) if isinstance(text, str) else 0
    return size


def _prompt_size(prompt: Any) -> int:
    """About how much prompt work a completion's ``prompt`` (as decoded) makes: characters to encode,
    token ids to check (``IDS_PER_UNIT`` a unit), a JSON object prompt counts as work for the pool."""
    size = 0
    for p in prompt if isinstance(prompt, list) else [prompt]:
        if isinstance(p, np.ndarray):
            size += 1 + len(p) // IDS_PER_UNIT
        elif isinstance(p, (str, list)):
            size += 1 + len(p)
        elif isinstance(p, (int, float)):
            size += 1
        else:
            size += INLINE_SIZE + 1
    return size


async def chat_choices(ctx: ServingContext, req: oa.ChatCompletionRequest, stages: Stages) -> list[Choice]:
    """The choices of a chat request; its prompt work runs in ``ctx``'s prompt pool, timed in ``stages``."""
    _check_common(ctx, req)
    _check_choices(ctx, 1, req.n, "n")
    if ctx.chat_template is None:
        raise oa.invalid(f"model {ctx.model_name!r} has no chat template; use /v1/completions",
                         "messages")
    size = _chat_size(req.messages) + (INLINE_SIZE if req.tools else 0)   # tools: schemas to render, check, join
    return await ctx.run_prompt_work(size, partial(_chat_choices, ctx, req, stages))


def _chat_choices(ctx: ServingContext, req: oa.ChatCompletionRequest, stages: Stages) -> list[Choice]:
    assert ctx.chat_template is not None
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    budget = Budget(requested, None, param, "messages")
    if req.prompt_schema is not None:
        with timed(stages, "tokenize"):
            registry = _registry(ctx)
            with _schema_errors("messages"):
                composed = registry.compose_chat(req.prompt_schema, req.messages, salt=req.cache_salt)
            max_tokens = ctx.admission.composed(composed, budget)
        if prompt_pins.cache_marks(req.messages):
            raise oa.invalid("cache_control marks are not supported with prompt_schema", "messages")
        return _choices(ctx, req, [Truncated(composed.token_ids)], [max_tokens], req.num_logprobs,
                        composed=[composed])
    tools = req.tool_request()
    kwargs = req.template_kwargs()
    with timed(stages, "render"):
        try:
            text = ctx.chat_template.render(req.messages, tools=tools.tools or None, **kwargs)
        except ValueError as exc:
            raise oa.invalid(str(exc), "messages") from None
    plan = _output_plan(ctx, req, tools, text)
    with timed(stages, "tokenize"):
        admitted = ctx.admission.text(text, budget, add_special_tokens=False)   # the template has BOS if any
    pins: list[PinSpec] = []
    if marks := prompt_pins.cache_marks(req.messages):
        with timed(stages, "render"):
            pins = prompt_pins.chat_pins(
                marks, admitted.prompt.ids,
                lambda m: ctx.chat_template.render(m, False, tools=tools.tools or None, **kwargs),
                lambda t: ctx.tokenizer.encode_array(t, False))
    return _choices(ctx, req, [admitted.prompt], [admitted.max_tokens], req.num_logprobs, output=plan,
                    pins=[pins])


async def completion_choices(ctx: ServingContext, req: oa.CompletionRequest, stages: Stages) -> list[Choice]:
    """The choices of a completion request; its prompt work runs in ``ctx``'s prompt pool, timed in
    ``stages``."""
    _check_common(ctx, req)
    size = _prompt_size(req.prompt)
    if req.prompt_schema is not None:
        return await ctx.run_prompt_work(size, partial(_schema_completion_choices, ctx, req,
                                                       req.prompt_schema, stages))
    prompts = oa.completion_prompts(req)
    _check_choices(ctx, len(prompts), req.n, "prompt")
    return await ctx.run_prompt_work(size, partial(_completion_choices, ctx, req, prompts, stages))


def _completion_choices(ctx: ServingContext, req: oa.CompletionRequest, prompts: list[str | np.ndarray],
                        stages: Stages) -> list[Choice]:
    echo_only = req.echo and req.max_tokens == 0
    budget = Budget(1 if echo_only else req.max_tokens, 16)
    admitted: list[Admitted] = []
    with timed(stages, "tokenize"):
        for prompt in prompts:
            admitted.append(ctx.admission.text(prompt, budget) if isinstance(prompt, str)
                            else ctx.admission.token_ids(prompt, budget))
    return _choices(ctx, req, [a.prompt for a in admitted], [a.max_tokens for a in admitted], req.logprobs,
                    echo=req.echo, echo_only=echo_only)


def _schema_completion_choices(ctx: ServingContext, req: oa.CompletionRequest, name: str,
                               stages: Stages) -> list[Choice]:
    if req.echo:
        raise oa.invalid("echo is not supported with prompt_schema", "echo")
    sources = oa.schema_prompts(req)
    _check_choices(ctx, len(sources), req.n, "prompt")
    registry = _registry(ctx)
    budget = Budget(req.max_tokens, 16)
    with timed(stages, "tokenize"):
        with _schema_errors("prompt"):
            composed = [registry.compose(name, source, salt=req.cache_salt) for source in sources]
        max_tokens = [ctx.admission.composed(c, budget) for c in composed]
    return _choices(ctx, req, [Truncated(c.token_ids) for c in composed], max_tokens, req.logprobs,
                    composed=composed)


# -- responses ----------------------------------------------------------------------------------


def _token_text(ctx: ServingContext, token_id: int) -> str:
    return ctx.tokenizer.decode([token_id], skip_special_tokens=False)


def _chat_logprobs(ctx: ServingContext, item_logprobs: list[TokenLogprobs],
                   token_ids: list[int]) -> oa.ChatLogprobs:
    content = []
    for token_id, lp in zip(token_ids, item_logprobs):
        text = _token_text(ctx, token_id)
        top = [oa.TopLogprob(t := _token_text(ctx, tid), value, list(t.encode())) for tid, value in lp.top]
        content.append(oa.ChatTokenLogprob(text, lp.logprob, list(text.encode()), top))
    return oa.ChatLogprobs(content)


def _completion_logprobs(ctx: ServingContext, item_logprobs: list[TokenLogprobs | None],
                         token_ids: list[int], offset: int) -> oa.CompletionLogprobs:
    """``item_logprobs[i]`` belongs to ``token_ids[i]`` (None: a prompt's first token); ``offset``:
    where the first token's text starts in the choice's text."""
    tokens, values, tops, offsets = [], [], [], []
    for token_id, lp in zip(token_ids, item_logprobs, strict=True):
        text = _token_text(ctx, token_id)
        tokens.append(text)
        values.append(None if lp is None else lp.logprob)
        tops.append(None if lp is None else {_token_text(ctx, tid): value for tid, value in lp.top})
        offsets.append(offset)
        offset += len(text)
    return oa.CompletionLogprobs(tokens, values, tops, offsets)


@dataclass(frozen=True)
class _Shown:
    """What a completion choice shows for one update (or for the whole response)."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]      # per token when logprobs were asked, else empty


def _shown(ctx: ServingContext, c: Choice, text: str, token_ids: list[int],
           logprobs: list[TokenLogprobs], with_prompt: bool) -> _Shown:
    """The output part (hidden for ``echo_only``), preceded by the echoed prompt if ``with_prompt``."""
    shown = _Shown("", [], []) if c.echo_only else _Shown(text, token_ids, list(logprobs))
    if not with_prompt:
        return shown
    prompt_ids = c.prompt_ids.tolist() if isinstance(c.prompt_ids, np.ndarray) else list(c.prompt_ids)
    return _Shown(ctx.tokenizer.decode(prompt_ids) + shown.text, prompt_ids + shown.token_ids,
                  c.output.prompt_logprobs + shown.logprobs)


async def run_to_end(job: GenerationJob) -> None:
    try:
        async for _ in job.events():
            pass
    finally:
        job.cancel()


def _finish_reason(c: Choice, reason: oa.FinishReason | None) -> oa.FinishReason | None:
    """``tool_calls`` for an output that ended (``stop``) with calls."""
    if reason == "stop" and c.chat is not None and c.chat.tool_calls:
        return "tool_calls"
    return reason


def _message(c: Choice) -> oa.ChatMessage:
    chat = c.chat
    if chat is None:
        return oa.ChatMessage("assistant", c.output.text)
    chat.feed(c.output.text, final=True)
    calls = [oa.ToolCall(call.id, oa.FunctionCall(call.name, call.arguments)) for call in chat.tool_calls]
    content: str | None = chat.content_text
    if calls and not content.strip():
        content = None
    return oa.ChatMessage("assistant", content, calls or None,
                          chat.reasoning_text if chat.separates_reasoning and chat.reasoning_text else None)


def chat_response(ctx: ServingContext, job: GenerationJob) -> oa.ChatCompletion:
    choices = []
    for c in job.choices:
        logprobs = None
        if c.sampling.logprobs is not None:
            logprobs = _chat_logprobs(ctx, c.output.logprobs, c.output.token_ids)
        message = _message(c)
        choices.append(oa.ChatChoice(c.index, message, _finish_reason(c, c.output.last.finish_reason), logprobs))
    return oa.ChatCompletion(_id("chatcmpl"), int(time.time()), ctx.model_name, choices, usage(job.choices))


def _chat_delta(c: Choice, delta: str, final: bool) -> oa.ChatDelta | None:
    """The delta a chat choice shows for ``delta`` of its text (None: nothing new to show)."""
    if c.chat is None:
        return oa.ChatDelta(content=delta) if delta else None
    pieces = c.chat.feed(delta, final=final)
    calls: list[oa.ToolCallDelta] = []
    for d in pieces.calls:
        if calls and calls[-1].index == d.index and calls[-1].function is not None:    # the call's start + arguments
            fn = calls[-1].function
            fn.arguments = (fn.arguments or "") + d.arguments
        else:
            calls.append(oa.ToolCallDelta(d.index, d.id, "function" if d.id is not None else None,
                                          oa.FunctionCallDelta(d.name, d.arguments)))
    if not (pieces.reasoning or pieces.content or calls):
        return None
    return oa.ChatDelta(content=pieces.content or None, reasoning_content=pieces.reasoning or None,
                        tool_calls=calls or None)


def completion_response(ctx: ServingContext, job: GenerationJob) -> oa.Completion:
    choices = []
    for c in job.choices:
        shown = _shown(ctx, c, c.output.text, c.output.token_ids, c.output.logprobs, c.echo)
        logprobs = None
        if c.sampling.logprobs is not None:
            logprobs = _completion_logprobs(ctx, shown.logprobs, shown.token_ids, 0)
        choices.append(oa.CompletionChoice(c.index, shown.text, c.output.last.finish_reason, logprobs))
    return oa.Completion(_id("cmpl"), int(time.time()), ctx.model_name, choices, usage(job.choices))


async def chat_stream(ctx: ServingContext, job: GenerationJob, first: Event,
                      include_usage: bool) -> AsyncIterator[bytes]:
    rid, created, model = _id("chatcmpl"), int(time.time()), ctx.model_name

    def chunk(choices: list[oa.ChatChunkChoice], use: oa.Usage | None = None) -> bytes:
        return event(oa.ChatCompletionChunk(rid, created, model, choices, use))

    try:
        for c in job.choices:
            yield chunk([oa.ChatChunkChoice(c.index, oa.ChatDelta(role="assistant", content=""))])
        ev: Event | None = first
        while ev is not None:
            update, c = ev.item.update, ev.choice
            logprobs = None
            if c.sampling.logprobs is not None and update.token_ids:
                logprobs = _chat_logprobs(ctx, ev.item.logprobs or [], update.token_ids)
            delta = _chat_delta(c, ev.delta, update.finished)
            if delta is not None or logprobs is not None:
                yield chunk([oa.ChatChunkChoice(c.index, delta or oa.ChatDelta(content=""), None, logprobs)])
            if update.finished:
                yield chunk([oa.ChatChunkChoice(c.index, oa.ChatDelta(), _finish_reason(c, update.finish_reason))])
            ev = await job.next_event()
        if include_usage:
            yield chunk([], usage(job.choices))
    except Exception as exc:  # noqa: BLE001 - reported in-band: the status line is already sent
        yield event(api_error(exc).body())
    finally:
        job.cancel()
    yield DONE


async def completion_stream(ctx: ServingContext, job: GenerationJob, first: Event,
                            include_usage: bool) -> AsyncIterator[bytes]:
    """A choice's first chunk carries its echoed prompt (and its prompt logprobs), as in vLLM."""
    rid, created, model = _id("cmpl"), int(time.time()), ctx.model_name
    offsets = {c.index: 0 for c in job.choices}
    started: set[int] = set()

    def chunk(choices: list[oa.CompletionChoice], use: oa.Usage | None = None) -> bytes:
        return event(oa.Completion(rid, created, model, choices, use))

    try:
        ev: Event | None = first
        while ev is not None:
            update, c = ev.item.update, ev.choice
            shown = _shown(ctx, c, ev.delta, update.token_ids, ev.item.logprobs or [],
                           c.echo and c.index not in started)
            started.add(c.index)
            logprobs = None
            if c.sampling.logprobs is not None and shown.token_ids:
                logprobs = _completion_logprobs(ctx, shown.logprobs, shown.token_ids, offsets[c.index])
            offsets[c.index] += len(shown.text)
            if shown.text or logprobs is not None or update.finished:
                yield chunk([oa.CompletionChoice(c.index, shown.text, update.finish_reason, logprobs)])
            ev = await job.next_event()
        if include_usage:
            yield chunk([], usage(job.choices))
    except Exception as exc:  # noqa: BLE001 - reported in-band: the status line is already sent
        yield event(api_error(exc).body())
    finally:
        job.cancel()
    yield DONE


async def start_stream(job: GenerationJob) -> Event:
    """The first event, awaited before the response starts so that a rejected request still gets
    its HTTP status (400, 429, 503) instead of a 200 stream holding an error."""
    try:
        first = await job.next_event()
    except BaseException:
        job.cancel()
        raise
    assert first is not None  # every choice ends with a finished update
    return first


def stream_response(body: AsyncIterator[bytes], job: GenerationJob) -> EventStreamResponse:
    return EventStreamResponse(body, on_close=job.cancel)


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"

