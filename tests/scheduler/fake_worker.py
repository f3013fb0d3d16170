"""A model-free worker for scheduler tests.

It follows the StepPlan contract like a real worker and simulates the KV cache: computing
position t of a request writes a hash of ``token_ids[: t + 1]`` (what real KV depends on) into slot
``pages[t // ps] * ps + t % ps``; before computing it checks that every earlier position's slot
holds exactly that request's prefix hash, so a wrong page list, a page reused too early or a
cached prefix that is not what it claims to be fails the test. Sampled tokens come from
``token_fn(rid, tokens_so_far)``. An admission leaves out its cached prefix's tokens
(``token_offset``): they are read back from the slots of the request's first pages, where each
computed position also records its token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

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

    def step(self, plan: StepPlan) -> StepOutput:
        self.plans.append(plan)
        for rid in plan.released:
            del self.table[rid]
        for adm in plan.admitted:
            assert adm.rid not in self.table
            row = _Row([], list(adm.pages), restarts=self.span_starts.get(adm.rid, frozenset()))
            row.tokens = [self.slot_tokens[self._slot(row, t)] for t in range(adm.token_offset)]
            row.tokens += adm.token_ids
            self.table[adm.rid] = row
        for app in plan.page_appends:
            self.table[app.rid].pages.extend(app.pages)
        if plan.step_id == self.error_at_step:
            return StepOutput(plan.step_id, [], [], error="boom")
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
        return StepOutput(plan.step_id, rids, tokens)

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
        run.steps += 1
        sched.check_integrity()
    return run


def collect(run: Run, updates: list[RequestUpdate]) -> None:
    for u in updates:
        run.tokens.setdefault(u.rid, []).extend(u.token_ids)
        if u.finished:
            assert u.rid not in run.finals
            run.finals[u.rid] = u
