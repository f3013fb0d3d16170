"""A model-free worker for scheduler tests.

It follows the StepPlan contract like a real worker and simulates the KV cache: computing
position t of a request writes a hash of ``token_ids[: t + 1]`` (what real KV depends on) into slot
``pages[t // ps] * ps + t % ps``; before computing it checks that every earlier position's slot
holds exactly that request's prefix hash, so a wrong page list, a page reused too early or a
cached prefix that is not what it claims to be fails the test. Reused partial pages
(``StepPlan.page_copies``) are copied slot by slot before the step computes. KV tier transfers are simulated too:
a save copies pages' slots into host slots, a load copies them back (and the save is acknowledged
with the step). Steps run when ``step`` is called; a driver that holds outputs back (overlap) says
which steps are still in flight (``delivered``), and a load that may start beside them
(``KVTransfers.loads_start_now``) into a page one of them writes fails the test. Sampled tokens come from
``token_fn(rid, tokens_so_far)``. An admission leaves out its cached prefix's tokens
(``token_offset``): they are read back from the slots of the request's first pages, where each
computed position also records its token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from radixrelay.protocol.kv import KVAcks, KVTransfers
from radixrelay.protocol.messages import RequestUpdate
from radixrelay.protocol.step import StepOutput, StepPlan
from radixrelay.scheduler import Scheduler

TokenFn = Callable[[int, list[int]], int]


def default_token_fn(rid: int, tokens: list[int]) -> int:
    return 100 + (rid * 7 + len(tokens) * 3) % 50


@dataclass
class _Row:
    tokens: list[int]
    pages: list[int]
    hashes: list[int] = field(default_factory=list)   # hashes[t] = hash of tokens[: t + 1]
    restarts: frozenset[int] = frozenset()            # positions whose KV does not see earlier ones

    def prefix_hash(self, t: int) -> int:
        while len(self.hashes) <= t:
            prev = self.hashes[-1] if self.hashes and len(self.hashes) not in self.restarts else 0
            self.hashes.append(hash((prev, self.tokens[len(self.hashes)])))
        return self.hashes[t]


@dataclass
class FakeWorker:
    page_size: int
    num_pages: int
    token_fn: TokenFn = default_token_fn
    error_at_step: int | None = None
    table: dict[int, _Row] = field(default_factory=dict)
    kv: dict[int, int] = field(default_factory=dict)   # slot -> prefix hash
    slot_tokens: dict[int, int] = field(default_factory=dict)   # slot -> token computed there
    plans: list[StepPlan] = field(default_factory=list)
    # modular prompts: rid -> first position of each module span (each span's KV sees only itself)
    span_starts: dict[int, frozenset[int]] = field(default_factory=dict)
    host: dict[tuple[int, int], tuple[int | None, int | None]] = field(default_factory=dict)  # (slot, i) -> KV
    written_by: dict[int, int] = field(default_factory=dict)   # page -> the last step that computed into it
    in_flight: set[int] = field(default_factory=set)           # steps run whose outputs were not delivered
    copied_from: dict[int, int] = field(default_factory=dict)  # page -> the last step that copied from it

    def delivered(self, step_id: int) -> None:
        """The driver handed step ``step_id``'s output to the scheduler: the step is done on the device."""
        self.in_flight.discard(step_id)

    def step(self, plan: StepPlan) -> StepOutput:
        self.plans.append(plan)
        self.in_flight.add(plan.step_id)
        for rid in plan.released:
            del self.table[rid]
        acks = self._transfers(plan.step_id, plan.transfers) if plan.transfers is not None else None
        ps = self.page_size
        for src, dst, n in plan.page_copies:            # reused partial pages, before the forward (and before
        # an admission's cached tokens are read back from its pages)
            assert 0 < n <= ps and src != dst
            for i in range(n):
                self.kv[dst * ps + i] = self.kv.get(src * ps + i)
                self.slot_tokens[dst * ps + i] = self.slot_tokens.get(src * ps + i)
            self.copied_from[src] = plan.step_id
            self.written_by[dst] = plan.step_id
        for adm in plan.admitted:
            assert adm.rid not in self.table
            row = _Row([], adm.page_list(lambda r: self.table[r].pages), restarts=self.span_starts.get(adm.rid, frozenset()))
            row.tokens = [self.slot_tokens[self._slot(row, t)] for t in range(adm.token_offset)]
            row.tokens += adm.token_ids
            self.table[adm.rid] = row
        for app in plan.page_appends:
            self.table[app.rid].pages.extend(app.pages)
        if plan.step_id == self.error_at_step:
            return StepOutput(plan.step_id, [], [], error="boom", kv_acks=acks)
        rids, tokens = [], []
        for ext in plan.extends:
            row = self.table[ext.rid]
            assert ext.start + ext.num_tokens <= len(row.tokens)
            self._compute(row, ext.start, ext.start + ext.num_tokens)
            if ext.sample:
                assert ext.start + ext.num_tokens == len(row.tokens)
                rids.append(ext.rid)
        for rid in plan.decodes:
            row = self.table[rid]
            self._compute(row, len(row.tokens) - 1, len(row.tokens))
            rids.append(rid)
        for rid in rids:
            row = self.table[rid]
            tokens.append(self.token_fn(rid, row.tokens))
            row.tokens.append(tokens[-1])
        return StepOutput(plan.step_id, rids, tokens, kv_acks=acks)

    def _transfers(self, step_id: int, t: KVTransfers) -> KVAcks | None:
        ps = self.page_size
        assert not (t.shifted_loads or t.disk_reads or t.disk_writes), "not simulated"
        for page, slot in t.saves:
            for i in range(ps):
                self.host[(slot, i)] = (self.kv.get(page * ps + i), self.slot_tokens.get(page * ps + i))
        for slot, page in t.loads:
            if t.loads_start_now:
                writer = self.written_by.get(page)
                assert writer is None or writer == step_id or writer not in self.in_flight, \
                    f"a load starting at once into page {page}, which step {writer} (in flight) writes"
                reader = self.copied_from.get(page)
                assert reader is None or reader not in self.in_flight, \
                    f"a load starting at once into page {page}, which step {reader} (in flight) copies from"
            for i in range(ps):
                self.kv[page * ps + i], self.slot_tokens[page * ps + i] = self.host.get((slot, i), (None, None))
        return KVAcks(saved_steps=[step_id]) if t.saves else None

    def _slot(self, row: _Row, t: int) -> int:
        page = row.pages[t // self.page_size]
        assert 0 <= page < self.num_pages
        return page * self.page_size + t % self.page_size

    def _compute(self, row: _Row, start: int, end: int) -> None:
        assert end <= len(row.pages) * self.page_size, "page list does not cover the positions"
        for t in range(start):
            assert self.kv.get(self._slot(row, t)) == row.prefix_hash(t), f"stale KV at {t}"
        for t in range(start, end):
            self.kv[self._slot(row, t)] = row.prefix_hash(t)
            self.slot_tokens[self._slot(row, t)] = row.tokens[t]
            self.written_by[row.pages[t // self.page_size]] = self.plans[-1].step_id


@dataclass
class Run:
    """Outputs collected per rid while driving a scheduler to idle."""
    tokens: dict[int, list[int]] = field(default_factory=dict)
    finals: dict[int, RequestUpdate] = field(default_factory=dict)
    steps: int = 0


def drive(sched: Scheduler, worker: FakeWorker, run: Run | None = None,
          max_steps: int = 10_000, until: Callable[[], bool] | None = None) -> Run:
    """Step until idle (or ``until()``), checking integrity after every step."""
    run = run or Run()
    while sched.has_work() and not (until and until()):
        assert run.steps < max_steps, "scheduler made no progress"
        plan = sched.schedule()
        assert plan is not None, "work left but nothing scheduled"
        collect(run, sched.process_output(worker.step(plan)))
        worker.delivered(plan.step_id)
        run.steps += 1
        sched.check_integrity()
    return run


def collect(run: Run, updates: list[RequestUpdate]) -> None:
    for u in updates:
        run.tokens.setdefault(u.rid, []).extend(u.token_ids)
        if u.finished:
            assert u.rid not in run.finals
            run.finals[u.rid] = u
