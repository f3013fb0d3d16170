"""Worker side of a step: the request table, the model, the KV memory and the sampler.

HOT FILE: only what runs every step belongs here (pack the batch, forward, sample). Loading lives in ``radixrelay.model.loader``, batch packing in
``radixrelay.attention.metadata``, sampling in ``radixrelay.worker.sampling``, prompt logprobs in
``radixrelay.worker.prompt_logprobs``, device-resident token state in ``radixrelay.worker.step_state``,
the decode graphs' rows in ``radixrelay.worker.device_batch``, the choice of forward path in
``radixrelay.worker.step_path``.

A step is launched, then finished: ``launch(plan)`` applies the diff, queues the forward pass and the
sampling on the device and starts copying the results to the host, without waiting for the device;
``LaunchedStep.finish()`` waits for those copies and returns the ``StepOutput``. Overlap scheduling
launches step N+1 before finishing step N: a decode feeds its request's newest token from the device
(``ResidentTokens``), so the host never needs step N's tokens to launch N+1. ``step(plan)`` does both.

The request table (``radixrelay.worker.request_table``: one entry per resident request, the only writer of
residency) mirrors the scheduler's view (``radixrelay.protocol.step`` states the invariants): for every
resident request, its tokens known at admission (extend inputs), how many it has sampled since (on
the device), and its page list. A decode computes the request's newest token, whose position is
``num_tokens - 1``.

Cascade: ``StepPlan.cascade`` (decode groups) and, with ``prefill_cost``, the extend rows' shared
cached pages become the batch's ``CascadeBatch`` (``radixrelay.cascade.batch``); the backend executes it.

Forward paths (``radixrelay.worker.step_path.choose_path`` picks them from facts of the plan and the
persistent batch; ``_forward`` runs the first that takes the step, one method each): ADVANCE / PATCH_ROWS,
a decode step continuing the last graph step, its rows one token further and any rows that changed
(joins, leaves) patched (``_advance``); EXTEND_ROWS, a step of small extends (``SMALL_EXTEND_ROWS``
tokens) as decode-graph rows, one per token (``_extend_rows``); DECODE_GRAPH, a decode-only step filled
into a decode graph (``_decode_graph``); PIECEWISE, piecewise graphs (attention launched between captured
pieces), or EAGER, the eager model (``_packed``). The persistent batch (``DeviceBatch``: the graph rows'
order and requests) is the runner's; ``_forward`` tells it what ran.

Host work per decode step is O(decode rows), never O(rows x pages), and most of it is kept while the
batch repeats (steady decode): the decode runs of a repeated plan and order (``DecodeRunsCache``, told
of every release), the device row indices of a repeated rid list (``DevicePageTable``,
``ResidentTokens``), the sampling tensors of the same request-table entries (``SamplingTensorsCache``).
Page-table and token writes of a step's diff are queued and made by one scatter each; the per-row batch
tensors reach the device in two packed copies (``build_forward_batch`` with ``DecodeRows``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from itertools import repeat
from operator import attrgetter, gt, mul

from typing import TYPE_CHECKING

import msgspec
import torch

from radixrelay.attention import AttentionBackend, KVCache
from radixrelay.attention.metadata import (
    BatchRequest, DecodeRows, DevicePageTable, ForwardBatch, SharedRun, build_forward_batch, build_shared_runs,
    to_device,
)
from radixrelay.cascade.batch import (
    LONG_PREFIX_TOKENS, DecodeRunsCache, long_prefix_runs, prefill_runs, shifted_runs,
)
from radixrelay.cascade.cost import CostModel
from radixrelay.model.llama import LlamaForCausalLM
from radixrelay.protocol.stats import WorkerCounters
from radixrelay.protocol.step import ExtendItem, StepOutput, StepPlan, positions_of
from radixrelay.worker.device_batch import DeviceBatch, GraphRun
from radixrelay.worker.graph_step import GraphStep, RowPatch
from radixrelay.worker.prompt_logprobs import PendingPromptLogprobs, num_logits_rows
from radixrelay.worker.request_table import RequestTable, Resident
from radixrelay.worker.sampling import LogprobsTensors, Sampler, SamplingTensorsCache, to_host
from radixrelay.worker.step_path import Path, StepFacts, StepPath, choose_path
from radixrelay.worker.step_state import ResidentTokens

# A step whose extends compute at most this many tokens in all (and no prompt logprobs) runs on the
# decode graphs, one row per extend token (``ModelRunner._extend_rows``): an idle server's cached
# prompt, a chat's next turn, a modular prompt's question reach their first token in one graph replay,
# and under load the step that admits them beside 256 decodes (cascade included) is one replay too,
# instead of a piecewise step whose layers of attention are launched from Python (its host launch is
# several times a replay's; benchmarks/results/HISTORY.md). The worker's decode graphs take
# max_running_requests + this many rows.
SMALL_EXTEND_ROWS = 256

if TYPE_CHECKING:   # cuda_graphs imports the Triton kernels; a torch-only worker never loads them
    from radixrelay.worker.constraints import Constraints
    from radixrelay.worker.cuda_graphs import DecodeGraphs
    from radixrelay.worker.kv_tiers import TierStore
    from radixrelay.worker.piecewise_graphs import PiecewiseGraphs


class LaunchedStep:
    """A step queued on the device; ``finish()`` waits for its results (once).

    A step with constrained rows launched while the previous step's tokens are not yet known is
    *deferred* (``deferred``): its forward is queued, its masking and sampling are not, because the masks
    need the previous tokens. ``complete()`` queues them; the worker loop first sends the older steps'
    outputs (the scheduler plans the next step meanwhile) and then completes it, so the grammar work is
    off the path from one step's output to the next plan. ``finish()`` and ``host_tokens()`` complete a
    deferred step first; ``ready()`` is False until it is completed."""

    def __init__(self, step_id: int, *, rids: list[int] | None = None, tokens: torch.Tensor | None = None,
                 logprobs: LogprobsTensors | None = None, num_logprobs: tuple[int | None, ...] = (),
                 prompt: list[PendingPromptLogprobs] | None = None, error: str | None = None,
                 launch_s: float = 0.0, events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None,
                 failed: list[tuple[int, str]] | None = None,
                 deferred: Callable[[], LaunchedStep] | None = None) -> None:
        self.step_id = step_id
        self._deferred = deferred      # queues the masking and sampling; returns the step they make
        self.rids = rids or []
        self._failed = failed or []    # (rid, why): requests failed alone (a grammar over its budget)
        self._tokens, self._logprobs, self._num_logprobs = tokens, logprobs, num_logprobs   # host copies
        self._prompt = prompt or []
        self._error = error
        self.launch_s = launch_s       # host time until the model's kernels were launched
        self._events = events          # CUDA: (start, done) around the step's device work
        self.device_s = 0.0            # device time of the step (CUDA), known after finish()
        self.capture_s = 0.0           # of launch_s: capturing CUDA graphs (set by the worker loop)

    @property
    def deferred(self) -> bool:
        return self._deferred is not None

    def complete(self) -> None:
        """Queue a deferred step's masking and sampling (nothing for a step that is not deferred)."""
        if self._deferred is None:
            return
        make, self._deferred = self._deferred, None
        done = make()
        self.rids, self._failed, self._error = done.rids, done._failed, done._error
        self._tokens, self._logprobs, self._num_logprobs = done._tokens, done._logprobs, done._num_logprobs
        self._prompt, self._events = done._prompt, done._events

    def host_tokens(self) -> list[int]:
        """The sampled tokens, waiting for the device if needed (grammar matchers read them)."""
        self.complete()
        if self._events is not None:
            self._events[1].synchronize()
        return [] if self._tokens is None else self._tokens.tolist()

    def ready(self) -> bool:
        """Whether ``finish()`` would return without waiting for the device."""
        if self._deferred is not None:
            return False
        return self._events is None or self._events[1].query()

    def finish(self) -> StepOutput:
        self.complete()
        if self._error is not None:
            return StepOutput(self.step_id, [], [], error=self._error)
        try:
            if self._events is not None:
                self._events[1].synchronize()
                self.device_s = self._events[0].elapsed_time(self._events[1]) / 1e3
            token_ids = [] if self._tokens is None else self._tokens.tolist()
            logprobs = None if self._logprobs is None else self._logprobs.to_protocol(self._num_logprobs)
            return StepOutput(self.step_id, self.rids, token_ids, logprobs, [p.chunk() for p in self._prompt],
                              failed=self._failed)
        except Exception as exc:  # noqa: BLE001 - a device fault fails the step, not the process
            return StepOutput(self.step_id, [], [], error=f"{type(exc).__name__}: {exc}")


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, backend: AttentionBackend,
                 *, seed: int = 0, prefill_cost: CostModel | None = None,
                 graphs: DecodeGraphs | None = None, piecewise: PiecewiseGraphs | None = None,
                 split_long_prefixes: bool | None = None, constraints: Constraints | None = None,
                 tiers: TierStore | None = None, counters: WorkerCounters | None = None) -> None:
        """``prefill_cost``: share cached runs of KV between extend rows when it says so (None: never);
        ``graphs``: run the decode-only steps that fit it as CUDA graphs (same model, cache, backend);
        ``piecewise``: run other steps that fit it as piecewise graphs (attention launched between them);
        ``constraints``: structured-output grammars (None: such requests are refused at admission);
        ``tiers``: host-memory / disk KV tiers (None: plans carrying transfers fail); ``counters``: the
        worker's, incremented in place here and by the graphs (None: the decode graphs', else new ones)."""
        self.tiers = tiers
        if tiers is not None:
            # shifted loads rotate keys like the model does, where its RoPE is a rotation by the position delta
            tiers.rotary = model.rotary if model.rotary.shifts_exactly else None
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.page_size = kv_cache.page_size
        self.device = kv_cache.device
        self.vocab_size = model.config.vocab_size
        generator = torch.Generator(device=self.device).manual_seed(seed)
        self.sampler = Sampler(generator)
        self._page_table = DevicePageTable(self.device)      # the residents' page lists, on the device
        self._tokens = ResidentTokens(self.device, self.vocab_size)
        self._sampling = SamplingTensorsCache()              # the sampling rows' tensors while they repeat
        self.prefill_cost = prefill_cost
        self._decode_runs = DecodeRunsCache(self.page_size, self.device, backend.splits_shared_pages(self.device))
        self.table = RequestTable(self._page_table, self._tokens, self._decode_runs, constraints)
        self.graphs = graphs
        self.piecewise = piecewise
        self.device_batch = DeviceBatch()    # the decode graphs' rows from step to step (told by ``_forward``)
        # Long cached prefixes of short extends read split along their length (cascade.batch): by default
        # where the backend's kernels split them (Triton on CUDA); the torch reference gains nothing from it.
        self._split_long_prefixes = (backend.splits_long_prefixes(self.device) if split_long_prefixes is None
                                     else split_long_prefixes)
        self.long_prefix_tokens = LONG_PREFIX_TOKENS
        self.small_extend_rows = SMALL_EXTEND_ROWS
        self._cuda = self.device.type == "cuda"
        self.counters = (counters if counters is not None else graphs.counters if graphs is not None
                         else WorkerCounters())
        self.constraints = constraints

    @property
    def graph_capture_s(self) -> float:
        """Host seconds spent capturing CUDA graphs (cumulative, start-up included)."""
        return ((self.graphs.capture_s if self.graphs is not None else 0.0)
                + (self.piecewise.capture_s if self.piecewise is not None else 0.0))

    @property
    def num_resident(self) -> int:
        return len(self.table)

    def step(self, plan: StepPlan) -> StepOutput:
        """Launch and finish one step (no overlap)."""
        return self.launch(plan).finish()

    def launch(self, plan: StepPlan) -> LaunchedStep:
        """Apply the plan's diff, queue its extends, decodes and sampling on the device. A failure
        comes back as ``StepOutput.error`` from ``finish()`` (the request table is left as the plan
        made it)."""
        start = time.perf_counter()
        try:
            self.table.apply(plan)
            if plan.transfers is not None and self.tiers is None:
                raise ValueError("the plan carries KV tier transfers but this worker has no tiers")
            if self.tiers is None:
                self.kv_cache.copy_page_prefixes(plan.page_copies)
                return self._launch(plan, start)
            if plan.transfers is not None:
                self.tiers.apply(plan.step_id, plan.transfers)    # loads: layer l before layer l's attention
            self.kv_cache.copy_page_prefixes(plan.page_copies)   # after the loads of the layers they read
            rows = bool(plan.extends or plan.decodes)
            if rows and not plan.extends:
                self.tiers.wait_for_loads()     # a decode step's graph cannot wait layer by layer: all before
            try:
                return self._launch(plan, start)
            finally:
                self.tiers.after_forward(rows)
        except Exception as exc:  # noqa: BLE001 - the scheduler turns this into request errors
            self.device_batch.ran_other()          # what the graph buffers hold is not known
            return LaunchedStep(plan.step_id, error=f"{type(exc).__name__}: {exc}")

    def _ban_before_min_tokens(self, residents: list[Resident], logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [len(residents), V] with EOS and stop ids at -inf on rows below their ``min_tokens``."""
        rows, ids = self.table.min_tokens_bans(residents)
        if not rows:
            return logits
        index = (to_device(rows, torch.int64, self.device), to_device(ids, torch.int64, self.device))
        return logits.index_put(index, torch.tensor(float("-inf"), device=self.device))

    def _launch(self, plan: StepPlan, start: float) -> LaunchedStep:
        changed = None
        if self.graphs is not None and plan.decodes and not plan.extends:
            order = self.device_batch.arrange(plan.decodes)   # stable graph rows: a changed batch is patched
            if order is not plan.decodes:
                plan = msgspec.structs.replace(plan, decodes=order)
            changed = self.device_batch.changed_rows(plan.decodes)
        # Rows of the flat batch: every extend chunk, then every decode (one token each). Logits
        # rows: per extend its prompt-logprobs run (if any), then its sampling row; one per decode.
        extends: list[BatchRequest] = []
        input_ids: list[int] = []
        samplers: list[int] = []
        sample_rows: list[int] = []                       # logits row of each sampler
        owed: list[tuple[ExtendItem, int]] = []           # (extend, its first logits row)
        num_rows = most_logits = 0
        for item in plan.extends:
            res = self.table[item.rid]
            lo = item.start - res.token_offset
            if lo < 0 or lo + item.num_tokens > len(res.token_ids):
                raise ValueError(f"request {item.rid}: extend [{item.start}, {item.start + item.num_tokens}) outside "
                                 f"the tokens sent [{res.token_offset}, {res.token_offset + len(res.token_ids)})")
            input_ids.extend(res.token_ids[lo:lo + item.num_tokens])
            num_logits = num_logits_rows(item)
            most_logits = max(most_logits, num_logits)
            extends.append(BatchRequest(res.pages, item.start, item.num_tokens, num_logits))
            if item.num_prompt_logprobs:
                owed.append((item, num_rows))
            num_rows += num_logits
            if item.sample:
                samplers.append(item.rid)
                sample_rows.append(num_rows - 1)
        decoding = list(map(self.table.__getitem__, plan.decodes))
        if not extends and not decoding:
            return LaunchedStep(plan.step_id)
        samplers.extend(plan.decodes)           # decodes sample too; their logits rows follow the extends'
        events = None
        if self._cuda:
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        path = choose_path(self._facts(plan, len(input_ids), most_logits, changed, decoding))
        logits = self._forward(path, plan, extends, decoding, input_ids, changed, events)
        if self.model.all_reduces_per_forward:              # tensor parallelism: count their device time
            self.model.tp.clock.forward(len(input_ids) + len(decoding), self.model.all_reduces_per_forward)
        launch_s = time.perf_counter() - start                               # the device may still be busy
        prompt = [self._prompt_logprobs(item, logits[row:row + item.num_prompt_logprobs]).to_host()
                  for item, row in owed]
        if samplers and owed:                                                # -> [len(samplers), V]
            sample_rows.extend(range(num_rows, num_rows + len(plan.decodes)))
            logits = logits.index_select(0, to_device(sample_rows, torch.int64, self.device))
        return self._sample(plan.step_id, samplers, decoding, logits, prompt, launch_s, events)

    def _sample(self, step_id: int, samplers: list[int], decoding: list[Resident], logits: torch.Tensor,
                prompt: list[PendingPromptLogprobs], launch_s: float, events) -> LaunchedStep:
        """Queue the sampling of ``samplers`` (extends that sample, then every decode; ``logits``: one row
        each) and the copies of the results to the host; deferred (``LaunchedStep.deferred``) when a
        constrained row's mask needs tokens of a step still on the device."""
        if not (samplers and self.constraints and self.constraints.waits_for_tokens()):
            return self._sampled(step_id, samplers, decoding, logits, prompt, launch_s, events)

        def deferred() -> LaunchedStep:
            try:
                return self._sampled(step_id, samplers, decoding, logits, prompt, launch_s, events)
            except Exception as exc:  # noqa: BLE001 - as in launch(): the scheduler turns this into request errors
                self.device_batch.ran_other()
                return LaunchedStep(step_id, error=f"{type(exc).__name__}: {exc}")

        self.counters.masked_steps_deferred += 1
        return LaunchedStep(step_id, launch_s=launch_s, deferred=deferred)

    def _sampled(self, step_id: int, samplers: list[int], decoding: list[Resident], logits: torch.Tensor,
                 prompt: list[PendingPromptLogprobs], launch_s: float, events) -> LaunchedStep:
        tokens = logprobs = None
        num_logprobs: tuple[int | None, ...] = ()
        if samplers:
            residents = [self.table[rid] for rid in samplers[:len(samplers) - len(decoding)]] + decoding
            tensors = self._sampling.get(residents, _PARAMS_OF, _outputs_of, self._tokens.penalties(samplers),
                                         vocab_size=logits.shape[-1], device=self.device)
            logits = logits.float()
            if self.constraints:                  # constrained rows resident: mask what their grammars forbid
                logits = self.constraints.mask(samplers, logits)
            if self.table.banned:
                logits = self._ban_before_min_tokens(residents, logits)
            out = self.sampler(logits, tensors)
            # rows of the newest-token table: the decode graph's own (kept by row) when it gathered them
            self._tokens.record(samplers, out.token_ids, self.device_batch.token_rows)
            for res in residents:
                res.num_tokens += 1
            tokens = to_host(out.token_ids)           # by a kernel: never behind a tier save's copies
            logprobs = None if out.logprobs is None else out.logprobs.to_host()
            num_logprobs = tensors.num_logprobs
        if events is not None:
            events[1].record()
        failed = self.constraints.take_failed() if self.constraints is not None else None
        if failed:
            self.counters.grammar_budget_failures += len(failed)
        launched = LaunchedStep(step_id, rids=samplers, tokens=tokens, logprobs=logprobs,
                                num_logprobs=num_logprobs, prompt=prompt, launch_s=launch_s, events=events,
                                failed=failed)
        if self.constraints and samplers:
            self.constraints.sampled(samplers, launched.host_tokens)
        return launched

    def _facts(self, plan: StepPlan, extend_tokens: int, most_logits: int, changed: list[int] | None,
               decoding: list[Resident]) -> StepFacts:
        """What ``choose_path`` reads of the step, the request table, the persistent batch and the graphs."""
        graphs, piecewise = self.graphs, self.piecewise
        return StepFacts(
            decodes=len(plan.decodes), extends=len(plan.extends), extend_tokens=extend_tokens,
            extend_logits=most_logits, tier_loads=self.kv_cache.layer_ready is not None,
            changed=None if changed is None else len(changed), modular=self.table.num_rope > 0,
            # (num_tokens - 1) // ps < len(pages) <=> num_tokens <= len(pages) * ps; C-level over the batch
            pages_hold=changed is not None and not any(map(gt, map(_NUM_TOKENS, decoding), map(
                mul, map(len, map(_PAGES, decoding)), repeat(self.page_size)))),
            graph_rows=graphs.max_batch if graphs is not None else 0, small_extend_rows=self.small_extend_rows,
            piecewise_tokens=piecewise.max_tokens if piecewise is not None else 0)

    def _forward(self, path: StepPath, plan: StepPlan, extends: list[BatchRequest], decoding: list[Resident],
                 input_ids: list[int], changed: list[int] | None, events) -> torch.Tensor:
        """logits of the step's rows, from the first of ``path``'s candidates that takes the step. The
        persistent batch is told here, and only here, what ran: a graph step (the next step may advance
        it) or another (piecewise, eager)."""
        for candidate in path.candidates:
            if candidate is Path.ADVANCE or candidate is Path.PATCH_ROWS:
                run = self._advance(plan, decoding, changed, events)
            elif candidate is Path.DECODE_GRAPH:
                run = self._decode_graph(plan, decoding, path.defer, events)
            elif candidate is Path.EXTEND_ROWS:
                run = self._extend_rows(plan, extends, decoding, input_ids, path.defer, events)
            else:
                self.device_batch.ran_other()
                return self._packed(candidate is Path.PIECEWISE, plan, extends, decoding, input_ids, events)
            if run is not None:
                self.device_batch.ran_graph(run)
                self.counters.graph_replays += 1
                return run.logits
        raise AssertionError(f"{path}: the last path never declines")

    def _advance(self, plan: StepPlan, decoding: list[Resident], changed: list[int],
                 events) -> GraphRun | None:
        """ADVANCE / PATCH_ROWS: the last graph step's rows one token further (``DecodeGraphs.advance``: no
        batch packing on the host), its ``changed`` rows (``DeviceBatch.arrange``) patched from host values
        computed for them alone; None when the graph declines."""
        runs = (self._decode_runs.get(plan.cascade, plan.decodes, self.table.pages_of) if plan.cascade is not None
                else None)
        patch = None
        if changed:
            rids = [plan.decodes[i] for i in changed]
            rows = self._decode_rows(rids, [decoding[i] for i in changed])
            table, page_rows, width = self._page_table.rows(rids)
            _, token_rows = self._tokens.rows(rids)
            own = self._decode_runs.own_start if runs is not None else None
            patch = RowPatch(changed, rows.positions, rows.slots, table, page_rows, width, token_rows,
                             None if own is None else [own[i] for i in changed])
        tokens = self._tokens.table()
        if events is not None:
            events[0].record()
        return self.graphs.advance(self.device_batch, plan.decodes, runs, tokens, self.table.appends, patch)

    def _decode_graph(self, plan: StepPlan, decoding: list[Resident], defer: bool, events) -> GraphRun | None:
        """DECODE_GRAPH: a decode-only step filled into a decode graph (None when its page lists are wider
        than the graphs, or an uncaptured size class is deferred). Host work is O(rows): positions, slots and
        page-table rows as flat lists, one upload (``DecodeGraphs.run``)."""
        table, page_rows, width = self._page_table.rows(plan.decodes)
        if not self.graphs.fits(len(decoding), width):
            return None
        rows = self._decode_rows(plan.decodes, decoding)
        runs = kv_start = None
        if plan.cascade is not None:
            runs = self._decode_runs.get(plan.cascade, plan.decodes, self.table.pages_of)
            kv_start = self._decode_runs.own_start
        tokens, token_rows = self._tokens.rows(plan.decodes)
        step = GraphStep(None, rows.positions, rows.slots, table, page_rows, width, kv_start=kv_start, runs=runs,
                         rope_delta=self._rope_delta(plan, decoding), tokens=tokens, token_rows=token_rows)
        if events is not None:
            events[0].record()
        return self.graphs.run(step, rids=plan.decodes, defer=defer)    # its logits: [num_rows, V]

    def _extend_rows(self, plan: StepPlan, extends: list[BatchRequest], decoding: list[Resident],
                     input_ids: list[int], defer: bool, events) -> GraphRun | None:
        """EXTEND_ROWS: a step of small extends run on the decode graphs (None when no graph fits it), in
        ``_launch``'s row order: each sampling extend's row, then the decodes.

        Each extend token is a decode row at its position, attending [0, position] of its request: every
        layer stores all rows' K/V before attention, so a token sees those before it in the same step
        (causal). An extend after a long cached prefix reads those whole pages as a shared run, once for
        all of its rows; the launch is planned for the run's length rounded up (``graph_step.round_length``),
        so that prompts of other lengths share the launch shape and the graph (a split past a run's end
        reads nothing). An extend of several tokens reads a shorter cached prefix as a run too, once its rows
        would read ``long_prefix_tokens`` in all on their own. Decodes with a cascade plan read its runs, their
        rows shifted past the extend rows. The next step cannot advance this one (no rids)."""
        ps = self.page_size
        positions: list[int] = []
        slots: list[int] = []
        keys: list[int] = []
        kv_start: list[int] = []
        runs: list[SharedRun] = []
        picks: list[int] = []
        for item, e in zip(plan.extends, extends):
            first = len(positions)
            pos = range(e.start, e.start + e.num_new)
            positions.extend(pos)
            slots.extend(e.pages[p // ps] * ps + p % ps for p in pos)
            keys.extend([item.rid] * e.num_new)
            cached = e.start // ps * ps
            as_run = cached > 0 and cached * e.num_new >= self.long_prefix_tokens    # KV reads as own ranges
            if as_run:
                runs.append(SharedRun(range(first, first + e.num_new), e.pages[:cached // ps], cached))
            kv_start.extend([cached if as_run else 0] * e.num_new)
            if e.num_logits:
                picks.append(len(positions) - 1)
        decodes = self._decode_rows(plan.decodes, decoding)
        own = [0] * len(plan.decodes)
        if plan.cascade is not None and plan.decodes:
            runs.extend(shifted_runs(self._decode_runs.get(plan.cascade, plan.decodes, self.table.pages_of), len(positions)))
            own = self._decode_runs.own_start
        picks.extend(range(len(positions), len(positions) + len(plan.decodes)))
        table, page_rows, width = self._page_table.rows(keys + plan.decodes)
        if not self.graphs.fits(len(positions) + len(plan.decodes), width):
            return None
        ids = to_device(input_ids, torch.int64, self.device)
        if plan.decodes:
            ids = torch.cat([ids, self._tokens.newest(plan.decodes)])
        shared = build_shared_runs(runs, self.device)
        step = GraphStep(ids, positions + list(decodes.positions), slots + list(decodes.slots), table, page_rows,
                         width, kv_start=kv_start + own if shared is not None else None,
                         runs=shared, rope_delta=self._rope_delta(plan, decoding), round_runs=True)
        if events is not None:
            events[0].record()
        run = self.graphs.run(step, defer=defer)
        if run is None:
            return None
        self.counters.extend_row_steps += 1
        return run._replace(logits=run.logits.index_select(0, to_device(picks, torch.int64, self.device)))

    def _packed(self, piecewise: bool, plan: StepPlan, extends: list[BatchRequest], decoding: list[Resident],
                input_ids: list[int], events) -> torch.Tensor:
        """PIECEWISE / EAGER: logits of the step's rows packed on the host (``build_forward_batch``), run on
        the piecewise graphs or by the eager model."""
        decodes = self._decode_rows(plan.decodes, decoding)
        batch = self._batch(plan, extends, decodes)
        rope_delta = self._rope_delta(plan, decoding)
        if rope_delta is not None:
            batch = dataclasses.replace(batch, rope_delta=to_device(rope_delta, torch.int64, self.device))
        if not plan.decodes:
            ids = to_device(input_ids, torch.int64, self.device)
        elif not input_ids:                               # decodes feed their newest token from the device
            ids = self._tokens.newest(plan.decodes)
        else:
            ids = torch.cat([to_device(input_ids, torch.int64, self.device), self._tokens.newest(plan.decodes)])
        if events is not None:
            events[0].record()
        if piecewise:
            self.counters.graph_replays += 1
            return self.piecewise.run(ids, batch)
        self.counters.eager_steps += 1
        return self.model(ids, batch, self.kv_cache, self.backend)

    def _decode_rows(self, rids: list[int], residents: list[Resident]) -> DecodeRows:
        """Each decode computes its newest token, at position ``num_tokens - 1``, into its page list's slot."""
        ps = self.page_size
        positions = [r.num_tokens - 1 for r in residents]
        try:
            slots = [r.pages[p // ps] * ps + p % ps for r, p in zip(residents, positions)]
        except IndexError:
            bad = next(i for i, (r, p) in enumerate(zip(residents, positions)) if p // ps >= len(r.pages))
            raise ValueError(f"request {rids[bad]}: {len(residents[bad].pages)} pages of {ps} cannot hold "
                             f"position {positions[bad]}") from None
        return DecodeRows(positions, slots)

    def _rope_delta(self, plan: StepPlan, decoding: list[Resident]) -> list[int] | None:
        """Per token of the step, RoPE position - KV index; None when all are 0 (no modular rows)."""
        if not self.table.num_rope:                    # no resident has modular rows: O(1), not O(batch)
            return None
        extending = [self.table[item.rid] for item in plan.extends]
        if not any(r.rope_runs for r in extending) and not any(r.rope_runs for r in decoding):
            return None
        deltas: list[int] = []
        for item, res in zip(plan.extends, extending):
            end = item.start + item.num_tokens
            pos = positions_of(res.rope_runs, item.start, end)
            deltas.extend(p - t for p, t in zip(pos, range(item.start, end)))
        for res in decoding:       # past the prompt: the last run's delta
            deltas.append(res.rope_runs[-1][1] if res.rope_runs and res.rope_runs[-1][0] < res.num_tokens else 0)
        return deltas if any(deltas) else None

    def _prompt_logprobs(self, item: ExtendItem, logits: torch.Tensor) -> PendingPromptLogprobs:
        res = self.table[item.rid]
        k = res.sampling.prompt_logprobs
        if k is None:
            raise ValueError(f"request {item.rid}: prompt logprobs owed but not requested")
        return PendingPromptLogprobs.compute(item, logits, res.token_ids, k)

    def _batch(self, plan: StepPlan, extends: list[BatchRequest], decodes: DecodeRows) -> ForwardBatch:
        num_extends = len(extends)
        decode_shared = prefill_shared = None
        if plan.cascade is not None and plan.decodes:
            decode_shared = self._decode_runs.get(plan.cascade, plan.decodes, self.table.pages_of)
        extend_start = [0] * num_extends
        runs = []
        if self.prefill_cost is not None and num_extends > 1:
            runs, extend_start = prefill_runs(extends, self.prefill_cost, self.page_size)
            if runs:               # a member reads its run's tokens (its extend_start) that the run reads once
                c = self.counters
                c.prefill_cascade_steps += 1
                c.prefill_cascade_runs += len(runs)
                c.prefill_cascade_tokens_read_once += sum(extend_start) - sum(r.num_tokens for r in runs)
        if self._split_long_prefixes and num_extends:
            long_runs = long_prefix_runs(extends, extend_start, self.page_size, min_prefix=self.long_prefix_tokens)
            self.counters.prefill_long_prefix_runs += len(long_runs)
            runs = runs + long_runs
        if runs:
            prefill_shared = build_shared_runs(runs, self.device)
        kv_start = None
        if decode_shared is not None or prefill_shared is not None:
            own = self._decode_runs.own_start if decode_shared is not None else [0] * len(plan.decodes)
            kv_start = extend_start + own
        keys = plan.decodes if not num_extends else [item.rid for item in plan.extends] + plan.decodes
        return build_forward_batch(extends, self.page_size, self.device, page_table=self._page_table.gather(keys),
                                   kv_start=kv_start, decode_runs=decode_shared, prefill_runs=prefill_shared,
                                   decodes=decodes)


_PARAMS_OF = attrgetter("sampling")         # Resident -> its SamplingParams (a C callable: mapped over the batch)
_NUM_TOKENS = attrgetter("num_tokens")
_PAGES = attrgetter("pages")


_outputs_of = attrgetter("num_outputs")       # Resident -> tokens sampled before this step
