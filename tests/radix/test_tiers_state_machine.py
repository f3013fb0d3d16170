"""Stateful property test: the scheduler with KV tiers (host memory, disk) against a worker model.

The fake worker models what the real one does with KV *content*: every KV position holds a label
``(salt, tuple(token_ids[: t + 1]))`` (what real KV depends on, plus the cache salt: serving KV
across salts is a bug even where the numbers would agree). A page is the tuple of its ``page_size``
labels, so the content of page ``i`` of a request names ``(salt, token_ids[: (i + 1) * page_size])``.
The worker keeps device pages, host slots and disk files as such tuples and executes each plan's
``KVTransfers`` with the freedom the protocol gives a real (CUDA) worker:

- a save reads its device pages at any moment between its plan and its acknowledgement (drawn:
  at once, before the step computes, or as late as possible), but before a later load from one of
  its host slots (saves and loads are on two copy streams, ordered per host slot) and before any
  later disk job (the disk thread waits for the copies queued before it);
- loads run before the step computes (the forward reads them);
- disk jobs run on one "thread" in plan order (within a plan: deletes, writes, reads), at once or as
  late as possible;
- acknowledgements come 0-2 outputs late (saves and disk operations each in order), and a plan
  without rows (no extends, no decodes) acknowledges everything outstanding.

Computing position ``t`` of a request first checks that positions ``[0, t)`` of its page list
hold exactly its labels (the cached prefix it reads: device hits and promotions alike), then writes
its label. Invariants after every rule: ``check_integrity``; every running request's committed
positions, every radix-tree page, every acknowledged host slot and every disk file hold the content
their owner / key names; tier sizes within capacity; with nothing in flight the disk index equals
the files on disk. Rules: arrivals (shared prefixes, follow-up turns, salts), steps, aborts, device
cache flushes, corrupted disk files, failed disk reads and failed saves. With two steps in flight the
harness, like the runtime loop, sometimes processes both outputs before it plans again.

The tests after the machine pin the bugs it found, each reduced to a deterministic case:
``test_integrity_with_saves_not_sent``, ``test_save_after_keys_went_further``,
``test_disk_prefix_longer_than_host_memory``, ``test_disk_delete_then_write_of_one_key`` (and
``test_worker_deletes_before_it_writes`` on the real worker),
``test_disk_prefixes_of_a_window_larger_than_host_memory`` (an LRU livelock across the look-ahead
window) and ``test_protection_ends_with_the_window`` (stale protection lost hits). The machine still
runs ``lru`` + disk with a look-ahead window of one request.
"""

from __future__ import annotations

import itertools
import random
from collections import deque
from dataclasses import dataclass, field

import msgspec
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixrelay.protocol.kv import KVAcks, KVTransfers
from radixrelay.protocol.messages import RequestUpdate
from radixrelay.protocol.step import StepOutput, StepPlan
from radixrelay.radix.page_keys import chain_seed, extend_keys
from radixrelay.radix.tiers import KVTiers
from radixrelay.sampling_params import SamplingParams
from radixrelay.scheduler import Scheduler, SchedulerConfig

NAMESPACE = "test-model;page_size=4"
PAGE_SIZE = 4
ALPHABET = st.integers(1, 3)
SALTS = [None, "a", "b"]
GARBAGE = ("garbage",)          # what a failed copy leaves in a host slot
CORRUPT = "corrupt"             # a disk file whose checksum no longer verifies

Label = tuple                   # (salt, tuple of tokens [0, t]) for one KV position


def next_token(tokens: list[int]) -> int:
    """Greedy "model": depends on the tokens only (same prefix, same continuation), alphabet 1..3."""
    return 1 + (sum(tokens) * 7 + len(tokens) * 3) % 3


def expected_output(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


def label(salt: str | None, tokens: list[int], t: int) -> Label:
    return salt, tuple(tokens[: t + 1])


def page_content(salt: str | None, tokens: list[int], i: int, ps: int) -> tuple:
    return tuple(label(salt, tokens, t) for t in range(i * ps, (i + 1) * ps))


@dataclass
class _Row:
    salt: str | None
    tokens: list[int]
    pages: list[int]


@dataclass
class _Save:
    seq: int
    step_id: int
    pairs: list[tuple[int, int]]        # (device page, host slot)
    due: int
    failed: bool
    done: bool = False


@dataclass
class _IO:
    seq: int
    kind: str                           # "write" | "read" | "delete"
    key: bytes
    slot: int
    due: int
    fail: bool = False
    done: bool = False
    ok: bool = True


@dataclass
class TierWorker:
    """Device KV, host slots and disk files as content labels; see the module docstring."""
    page_size: int
    num_pages: int
    host_pages: int
    rng: random.Random
    salts: dict[int, str | None]                        # rid -> cache salt (the plan does not say)
    history: dict[int, list[int]]                       # rid -> tokens the worker last knew
    device: dict[int, Label] = field(default_factory=dict)          # token slot -> label
    host: dict[int, tuple] = field(default_factory=dict)            # host slot -> page content
    disk: dict[bytes, tuple | str] = field(default_factory=dict)    # key -> page content | CORRUPT
    table: dict[int, _Row] = field(default_factory=dict)
    saves: deque[_Save] = field(default_factory=deque)
    io: deque[_IO] = field(default_factory=deque)
    clock: int = 0
    fail_next_save: bool = False
    fail_next_read: bool = False
    seq: itertools.count = field(default_factory=itertools.count)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("saves", "loads", "writes", "reads", "read_failed", "save_failed", "deletes"), 0))

    # -- one step ------------------------------------------------------------------------------

    def step(self, plan: StepPlan) -> StepOutput:
        for rid in plan.released:
            row = self.table.pop(rid, None)
            if row is not None:
                self.history[rid] = row.tokens
        for adm in plan.admitted:
            assert adm.rid not in self.table, f"request {adm.rid} admitted twice"
            known = self.history[adm.rid]
            tokens = known[: adm.token_offset] + list(adm.token_ids)
            assert tokens == known, f"request {adm.rid}: admission tokens disagree with the worker's"
            assert adm.num_prompt_tokens <= len(tokens)
            self.table[adm.rid] = _Row(self.salts[adm.rid], tokens, adm.page_list(lambda r: self.table[r].pages))
        for app in plan.page_appends:
            self.table[app.rid].pages.extend(app.pages)
        if plan.transfers is not None:
            self._apply(plan.step_id, plan.transfers)
        ps = self.page_size
        for src, dst, n in plan.page_copies:        # reused partial pages: after the loads, before computing
            for j in range(n):
                self.device[dst * ps + j] = self.device.get(src * ps + j)
        rids = []
        for ext in plan.extends:
            row = self.table[ext.rid]
            assert ext.start + ext.num_tokens <= len(row.tokens)
            self._compute(ext.rid, row, ext.start, ext.start + ext.num_tokens)
            if ext.sample:
                assert ext.start + ext.num_tokens == len(row.tokens)
                rids.append(ext.rid)
        for rid in plan.decodes:
            row = self.table[rid]
            self._compute(rid, row, len(row.tokens) - 1, len(row.tokens))
            rids.append(rid)
        tokens = []
        for rid in rids:
            row = self.table[rid]
            tokens.append(next_token(row.tokens))
            row.tokens.append(tokens[-1])
        return StepOutput(plan.step_id, rids, tokens)

    def _slot(self, row: _Row, t: int) -> int:
        page = row.pages[t // self.page_size]
        assert 0 <= page < self.num_pages
        return page * self.page_size + t % self.page_size

    def _compute(self, rid: int, row: _Row, start: int, end: int) -> None:
        assert end <= len(row.pages) * self.page_size, "page list does not cover the positions"
        for t in range(start):      # the cached prefix (and earlier chunks) this step reads
            got = self.device.get(self._slot(row, t))
            want = label(row.salt, row.tokens, t)
            assert got == want, (f"request {rid} (salt {row.salt!r}) reads wrong KV at position {t} "
                                 f"(page {row.pages[t // self.page_size]}): {got} != {want}")
        for t in range(start, end):
            self.device[self._slot(row, t)] = label(row.salt, row.tokens, t)

    def page(self, page: int) -> tuple:
        ps = self.page_size
        return tuple(self.device.get(page * ps + j) for j in range(ps))

    # -- transfers -----------------------------------------------------------------------------

    def _due(self) -> int:
        return self.clock + self.rng.choice((0, 1, 2))

    def _apply(self, step_id: int, t: KVTransfers) -> None:
        for page, slot in t.saves:
            assert 0 <= page < self.num_pages and 0 <= slot < self.host_pages
        for slot, page in t.loads:
            assert 0 <= page < self.num_pages and 0 <= slot < self.host_pages
        if t.saves:
            save = _Save(next(self.seq), step_id, list(t.saves), self._due(), self.fail_next_save)
            self.fail_next_save = False
            self.saves.append(save)
            if self.rng.random() < 0.5:
                self._run_save(save)        # before this step computes: the earliest it may run
        if t.loads:
            slots = {slot for slot, _ in t.loads}
            for save in self.saves:         # a load waits for earlier saves into its host slots
                if any(slot in slots for _, slot in save.pairs):
                    self._run_save(save)
            for slot, page in t.loads:
                content = self.host.get(slot, (None,) * self.page_size)
                for j in range(self.page_size):
                    self.device[page * self.page_size + j] = content[j] if j < len(content) else None
                self.counts["loads"] += 1
        # the worker's order: deletes, then writes, then reads (radixrelay/worker/kv_tiers.py)
        ops = [_IO(next(self.seq), "delete", key, -1, self._due()) for key in t.disk_deletes]
        ops += [_IO(next(self.seq), "write", key, slot, self._due()) for slot, key in t.disk_writes]
        ops += [_IO(next(self.seq), "read", key, slot, self._due()) for key, slot in t.disk_reads]
        for op in ops:
            if op.kind == "read" and self.fail_next_read:
                op.fail, self.fail_next_read = True, False
            self.io.append(op)
        if ops and self.rng.random() < 0.5:
            for op in self.io:
                self._run_io(op)

    def _run_save(self, save: _Save) -> None:
        if save.done:
            return
        save.done = True
        for page, slot in save.pairs:
            self.host[slot] = GARBAGE if save.failed else self.page(page)
            self.counts["save_failed" if save.failed else "saves"] += 1

    def _run_io(self, op: _IO) -> None:
        if op.done:
            return
        for save in self.saves:             # the disk thread waits for the copies queued before it
            if save.seq < op.seq:
                self._run_save(save)
        op.done = True
        if op.kind == "write":
            self.disk[op.key] = self.host[op.slot]
            self.counts["writes"] += 1
        elif op.kind == "read":
            content = self.disk.get(op.key)
            if op.fail or content is None or content == CORRUPT:
                op.ok = False
                self.disk.pop(op.key, None)     # a truncated / corrupt file is deleted on read
                self.counts["read_failed"] += 1
            else:
                self.host[op.slot] = content
                self.counts["reads"] += 1
        else:
            self.disk.pop(op.key, None)
            self.counts["deletes"] += 1

    def collect_acks(self, wait: bool) -> KVAcks | None:
        """What completed since the last output (``wait``: everything queued)."""
        self.clock += 1
        saved, failed = [], []
        while self.saves and (wait or self.saves[0].due <= self.clock):
            save = self.saves.popleft()
            self._run_save(save)
            (failed if save.failed else saved).append(save.step_id)
        written, read, read_failed = [], [], []
        while self.io and (wait or self.io[0].due <= self.clock):
            op = self.io.popleft()
            self._run_io(op)
            if op.kind == "write":
                written.append(op.key)
            elif op.kind == "read":
                (read if op.ok else read_failed).append(op.key)
        if not (saved or failed or written or read or read_failed):
            return None
        return KVAcks(saved, failed, written, [], read, read_failed)

    @property
    def idle(self) -> bool:
        """Nothing the scheduler waits for (disk deletes are never acknowledged)."""
        return not self.saves and all(op.kind == "delete" for op in self.io)

    def settle(self) -> None:
        """Run the deletes left on the disk thread (the scheduler awaits none)."""
        assert self.idle
        while self.io:
            self._run_io(self.io.popleft())


class TiersMachine(RuleBasedStateMachine):
    @initialize(num_pages=st.integers(12, 24), host_pages=st.integers(6, 16),
                disk_pages=st.sampled_from([0, 0, 10, 16, 30]), tier_policy=st.sampled_from(["lru", "scheduler"]),
                schedule_policy=st.sampled_from(["lpm", "fcfs", "dfs-weight"]),
                chunk=st.sampled_from([4, 8, 64]), max_running=st.integers(2, 6), depth=st.sampled_from([1, 2]),
                lookahead=st.sampled_from([1, 4, 32]), reserve=st.sampled_from([0.0, 0.5]),
                seed=st.integers(0, 2**32 - 1),
                bases=st.lists(st.lists(ALPHABET, min_size=24, max_size=24), min_size=3, max_size=3))
    def setup(self, num_pages, host_pages, disk_pages, tier_policy, schedule_policy, chunk, max_running,
              depth, lookahead, reserve, seed, bases) -> None:
        ps = PAGE_SIZE
        if tier_policy == "lru" and disk_pages:
            lookahead = 1   # a larger window livelocks: test_disk_prefixes_of_a_window_larger_than_host_memory
        self.cfg = SchedulerConfig(kv_cache_tokens=num_pages * ps, page_size=ps, max_running_requests=max_running,
                                   chunked_prefill_tokens=chunk, schedule_policy=schedule_policy,
                                   decode_reservation_ratio=reserve, kv_namespace=NAMESPACE,
                                   tier_lookahead=lookahead)
        self.tiers = KVTiers(host_pages, disk_pages, policy=tier_policy)
        self.sched = Scheduler(self.cfg, tiers=self.tiers)
        self.salts: dict[int, str | None] = {}
        self.history: dict[int, list[int]] = {}
        self.worker = TierWorker(ps, num_pages, host_pages, random.Random(seed), self.salts, self.history)
        self.depth = depth
        self.bases = bases
        self.rids = itertools.count()
        self.live: dict[int, tuple[list[int], int]] = {}      # rid -> (prompt, max_tokens)
        self.outputs: dict[int, list[int]] = {}
        self.conversations: list[tuple[str | None, list[int]]] = []   # finished: (salt, prompt + output)
        self.inflight: deque[tuple[StepOutput, bool]] = deque()
        self.contents: dict[bytes, tuple] = {}                # page key -> the content it names
        self.stats = dict.fromkeys(("aborted", "finished", "steps"), 0)

    # -- helpers -------------------------------------------------------------------------------

    def _register_keys(self, salt: str | None, tokens: list[int]) -> None:
        ps = self.cfg.page_size
        keys = extend_keys([], chain_seed(NAMESPACE, salt), tokens, ps, len(tokens) // ps)
        for i, key in enumerate(keys):
            content = page_content(salt, tokens, i, ps)
            assert self.contents.setdefault(key, content) == content, "page key collision"

    def _collect(self, updates: list[RequestUpdate]) -> None:
        for u in updates:
            self.outputs.setdefault(u.rid, []).extend(u.token_ids)
            if not u.finished:
                continue
            prompt, max_tokens = self.live.pop(u.rid)
            assert u.error is None
            if u.finish_reason == "abort":
                continue
            assert u.finish_reason == "length"
            got = self.outputs[u.rid]
            assert got == expected_output(prompt, max_tokens), f"request {u.rid}: wrong output"
            self.conversations.append((self.salts[u.rid], prompt + got))
            self.stats["finished"] += 1

    def _cycle(self) -> None:
        """Plan (if the pipeline has room) and/or deliver the oldest output, as the runtime loop."""
        sched = self.sched
        plan = sched.schedule() if len(self.inflight) < self.depth else None
        if plan is not None:
            out = self.worker.step(plan)
            self.inflight.append((out, bool(plan.extends or plan.decodes)))
            self.stats["steps"] += 1
            for rid, row in self.worker.table.items():
                self._register_keys(row.salt, row.tokens)
        if self.inflight and (plan is None or len(self.inflight) >= self.depth):
            # the runtime drains every output that has arrived before it plans again
            for _ in range(len(self.inflight) if self.worker.rng.random() < 0.5 else 1):
                out, has_rows = self.inflight.popleft()
                acks = self.worker.collect_acks(wait=not has_rows)
                self._collect(sched.process_output(msgspec.structs.replace(out, kv_acks=acks)))
        elif plan is None:
            assert not sched.has_work(), "work left, nothing in flight, and nothing scheduled"

    def _busy(self) -> bool:
        return self.sched.has_work() or bool(self.inflight)

    # -- rules ---------------------------------------------------------------------------------

    @rule(data=st.data(), count=st.integers(1, 3))
    def add_requests(self, data: st.DataObject, count: int) -> None:
        """Arrivals: a cut of a base sequence plus a tail, or (mostly) the next turn of a finished
        conversation; salts None / "a" / "b" (a follow-up keeps its salt, now and then not)."""
        for _ in range(count):
            max_tokens = data.draw(st.integers(1, 6), label="max_tokens")
            tail = data.draw(st.lists(ALPHABET, max_size=6), label="tail")
            if self.conversations and data.draw(st.integers(0, 3), label="follow_up") > 0:
                salt, history = data.draw(st.sampled_from(self.conversations), label="conversation")
                if data.draw(st.integers(0, 4), label="salt_change") == 0:
                    salt = data.draw(st.sampled_from(SALTS), label="salt")
                prompt = history + tail
            else:
                base = data.draw(st.sampled_from(self.bases), label="base")
                prompt = base[: data.draw(st.integers(0, len(base)), label="cut")] + tail
                salt = data.draw(st.sampled_from(SALTS), label="salt")
            if not prompt or self.cfg.pages_for(len(prompt) + max_tokens - 1) > self.cfg.num_pages:
                continue
            rid = next(self.rids)
            self.salts[rid] = salt
            self.history[rid] = list(prompt)
            self.live[rid] = (list(prompt), max_tokens)
            self._register_keys(salt, prompt)
            self.sched.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens), cache_salt=salt)

    @rule(n=st.integers(1, 10))
    def steps(self, n: int) -> None:
        for _ in range(n):
            if not self._busy():
                return
            self._cycle()

    @rule()
    def drain(self) -> None:
        """Run until every request finished and every transfer is acknowledged."""
        for _ in range(2000):
            if not self._busy():
                return
            self._cycle()
        raise AssertionError("the scheduler did not drain")

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)), label="abort_rid")
        update = self.sched.abort(rid)
        assert update is not None and update.finished and update.finish_reason == "abort"
        self._collect([update])
        self.stats["aborted"] += 1

    @rule()
    def flush_device_cache(self) -> None:
        """Empty the radix tree (refused while requests are live): the next turns come from the tiers."""
        assert self.sched.flush_cache() == (not self.live)

    @rule(data=st.data(), kind=st.sampled_from(["corrupt", "fail_read", "fail_save"]))
    def fault(self, data: st.DataObject, kind: str) -> None:
        """A disk file's checksum stops verifying; the next disk read finds its file truncated; the
        next plan's saves fail (their slots hold garbage, acknowledged in ``failed_steps``)."""
        if kind == "corrupt" and self.worker.disk:
            key = data.draw(st.sampled_from(sorted(self.worker.disk)), label="corrupt_key")
            self.worker.disk[key] = CORRUPT
        elif kind == "fail_read":
            self.worker.fail_next_read = True
        elif kind == "fail_save":
            self.worker.fail_next_save = True

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        sched, worker, tiers = self.sched, self.worker, self.tiers
        ps = self.cfg.page_size
        sched.check_integrity()
        # every running request's committed KV (its cached prefix included) is its own
        for req in sched._running.values():
            for t in range(req.hold.kv_committed):
                page = req.hold.pages[t // ps]
                got, want = worker.device.get(page * ps + t % ps), label(req.salt, req.token_ids, t)
                assert got == want, f"request {req.rid}: position {t} on page {page} holds {got}, not {want}"
        # every cached page holds the KV of its radix path
        tree = sched.cache.tree
        for node in tree.nodes():
            path = tree.path(node)
            root = path[0].parent
            tokens = [tok for n in path for tok in n.key]
            first = (len(tokens) - len(node.key)) // ps
            for j, page in enumerate(node.pages):
                want = page_content(root.salt, tokens, first + j, ps)
                assert worker.page(page) == want, f"cached page {page} (salt {root.salt!r}) holds stale KV"
        # host memory and disk: an acknowledged slot / a file holds what its key names
        assert tiers.num_host_entries <= tiers.host_pages
        assert tiers.num_disk_entries <= tiers.disk_pages
        for key, entry in tiers._host.items():
            assert key in self.contents, "host entry for a key no request ever had"
            if entry.state == "ready":
                assert worker.host.get(entry.slot) == self.contents[key], \
                    f"host slot {entry.slot} does not hold the page its key names"
        for key, content in worker.disk.items():
            if content != CORRUPT:
                assert content == self.contents[key], "disk file does not hold the page its key names"
        if not tiers.busy() and not self.inflight:
            assert worker.idle, "the worker holds transfers the scheduler no longer waits for"
            worker.settle()
            assert set(tiers._disk) == set(worker.disk), (
                f"disk index != files: index only {len(set(tiers._disk) - set(worker.disk))}, "
                f"files only {len(set(worker.disk) - set(tiers._disk))}")

    def teardown(self) -> None:
        if not hasattr(self, "sched"):
            return
        for _ in range(2000):
            if not self._busy():
                break
            self._cycle()
            self.consistent()
        else:
            raise AssertionError("the scheduler did not drain")
        assert not self.live, f"requests never finished: {sorted(self.live)}"
        assert self.worker.idle and not self.tiers.busy()
        assert all(e.state == "ready" and not e.writing for e in self.tiers._host.values())
        self.consistent()
        assert self.sched.flush_cache()
        assert self.sched.cache.allocator.num_free == self.cfg.num_pages, "device pages leaked"
        assert self.sched.cache.tree.cached_tokens == 0


TiersMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
test_tiers_state_machine = TiersMachine.TestCase


def test_integrity_with_saves_not_sent() -> None:
    """A request that finishes queues the saves of its pages; until the next plan takes them, the
    scheduler's state is consistent, so ``check_integrity`` (and ``Scheduler.audit``, which a stats
    request runs between an output and the next plan) must pass."""
    cfg = SchedulerConfig(kv_cache_tokens=48, page_size=PAGE_SIZE, kv_namespace=NAMESPACE)
    sched = Scheduler(cfg, tiers=KVTiers(host_pages=6))
    sched.add_request(0, [1] * 9, SamplingParams(max_tokens=1))
    plan = sched.schedule()
    sched.process_output(StepOutput(plan.step_id, [0], [2]))     # finished: 2 page saves queued
    assert sched.cache.tiers.store.has_outgoing()
    sched.check_integrity()


def test_save_after_keys_went_further() -> None:
    """A request retracted mid-prefill saves its committed whole pages. Its admission computed the
    keys of its whole reusable prefix (``promote``), more than it committed: the save must use the
    first keys only (it indexed past its page list: IndexError, host slots leaked)."""
    cfg = SchedulerConfig(kv_cache_tokens=12 * PAGE_SIZE, page_size=PAGE_SIZE, chunked_prefill_tokens=4,
                          decode_reservation_ratio=0.0, kv_namespace=NAMESPACE)
    sched = Scheduler(cfg, tiers=KVTiers(host_pages=16))
    history: dict[int, list[int]] = {0: [1, 2, 3], 1: list(range(1, 38))}
    worker = TierWorker(PAGE_SIZE, cfg.num_pages, 16, random.Random(0), {0: None, 1: None}, history)
    sched.add_request(0, history[0], SamplingParams(max_tokens=30))      # decodes: a page every 4 tokens
    for _ in range(2):
        sched.process_output(worker.step(sched.schedule()))
    sched.add_request(1, history[1], SamplingParams(max_tokens=1))       # 10 pages, prefilled 4 tokens a step
    for _ in range(12):     # request 0 runs out of pages: request 1 is retracted mid-prefill
        plan = sched.schedule()
        sched.process_output(msgspec.structs.replace(worker.step(plan), kv_acks=worker.collect_acks(True)))
    assert sched.stats().num_retractions > 0


@pytest.mark.parametrize("policy", ["lru", "scheduler"])
def test_disk_prefix_longer_than_host_memory(policy: str) -> None:
    """A request whose cached prefix is on disk only (here: found at start-up, as after a restart)
    and longer than host memory: prefetching must stop when host memory is full, and the request
    must be admitted with the pages that arrived (and compute the rest). With ``lru`` it was never
    admitted: fetching the chain's next page evicted its first ones, the request waited for the
    fetch, and the next ``schedule()`` fetched the evicted pages again."""
    prompt = list(range(1, 31))                     # 7 whole reusable pages; host memory holds 6
    keys = extend_keys([], chain_seed(NAMESPACE, None), prompt, PAGE_SIZE, 7)
    cfg = SchedulerConfig(kv_cache_tokens=12 * PAGE_SIZE, page_size=PAGE_SIZE, kv_namespace=NAMESPACE,
                          disk_min_tokens=0)         # pages of 4 tokens: read even so short a run
    sched = Scheduler(cfg, tiers=KVTiers(host_pages=6, disk_pages=16, disk_keys=keys, policy=policy))
    worker = TierWorker(PAGE_SIZE, cfg.num_pages, 6, random.Random(0), {0: None}, {0: list(prompt)})
    worker.disk = {key: page_content(None, prompt, i, PAGE_SIZE) for i, key in enumerate(keys)}
    sched.add_request(0, prompt, SamplingParams(max_tokens=1))
    for _ in range(50):
        if not sched.has_work():
            break
        plan = sched.schedule()
        out = worker.step(plan)
        acks = worker.collect_acks(wait=not (plan.extends or plan.decodes))
        sched.process_output(msgspec.structs.replace(out, kv_acks=acks))
    assert not sched.has_work(), f"not admitted after 50 steps ({worker.counts['reads']} disk reads)"
    assert sched.stats().tier_disk_hit_tokens > 0


def test_a_disk_run_shorter_than_the_minimum_is_computed() -> None:
    """Seven pages of 4 tokens on disk, fewer than ``disk_min_tokens`` (64): no disk read at all, the
    request computes its prompt."""
    prompt = list(range(1, 31))
    keys = extend_keys([], chain_seed(NAMESPACE, None), prompt, PAGE_SIZE, 7)
    cfg = SchedulerConfig(kv_cache_tokens=12 * PAGE_SIZE, page_size=PAGE_SIZE, kv_namespace=NAMESPACE)
    assert cfg.disk_min_tokens == 64
    sched = Scheduler(cfg, tiers=KVTiers(host_pages=6, disk_pages=16, disk_keys=keys))
    worker = TierWorker(PAGE_SIZE, cfg.num_pages, 6, random.Random(0), {0: None}, {0: list(prompt)})
    worker.disk = {key: page_content(None, prompt, i, PAGE_SIZE) for i, key in enumerate(keys)}
    sched.add_request(0, prompt, SamplingParams(max_tokens=1))
    for _ in range(50):
        if not sched.has_work():
            break
        plan = sched.schedule()
        out = worker.step(plan)
        sched.process_output(msgspec.structs.replace(out, kv_acks=worker.collect_acks(wait=True)))
    assert not sched.has_work() and worker.counts["reads"] == 0
    assert sched.stats().tier_disk_hit_tokens == 0 and sched.stats().cache_hit_tokens == 0


def test_disk_delete_then_write_of_one_key() -> None:
    """Two outputs processed without a plan in between (the runtime drains every output that has
    arrived, or ``schedule()`` returns None to wait before a retraction): the first acknowledges a
    write that pushes key A off the full disk (delete A queued), the second the save of A (saved
    again from the device while it was on disk: write A queued). One plan then carries both: the
    worker must delete before it writes (it wrote first, leaving a key in the index whose file was
    gone)."""
    A, B = b"A" * 16, b"B" * 16
    others = [bytes([i]) * 16 for i in range(4)]
    tiers = KVTiers(host_pages=4, disk_pages=1)
    files: set[bytes] = set()
    step = itertools.count()

    def send() -> None:         # what the worker does with the plan's disk transfers, in its order
        t = tiers.take(next(step))
        if t is not None:
            files.difference_update(t.disk_deletes)      # the worker deletes first
            files.update(key for _, key in t.disk_writes)

    tiers.save([A], [0])
    send()                                                  # step 0: save A
    tiers.on_acks(KVAcks(saved_steps=[0]))
    send()                                                  # step 1: write A
    tiers.on_acks(KVAcks(written=[A]))
    tiers.save(others, [1, 2, 3, 4])                        # evicts A from host memory
    send()                                                  # step 2
    tiers.on_acks(KVAcks(failed_steps=[2]))
    assert tiers.host_state(A) is None and tiers.on_disk(A)
    tiers.save([A], [5])                                    # A again, from the device
    send()                                                  # step 3
    tiers.save([B], [6])
    send()                                                  # step 4
    tiers.on_acks(KVAcks(saved_steps=[4]))
    send()                                                  # step 5: write B
    tiers.on_acks(KVAcks(written=[B]))                      # disk full: delete A queued
    tiers.on_acks(KVAcks(saved_steps=[3]))                  # no plan in between: write A queued
    send()                                                  # step 6: both
    tiers.on_acks(KVAcks(written=[A]))
    assert not tiers.on_disk(A) or A in files, "the disk index holds a key whose file was deleted"


def test_worker_deletes_before_it_writes(tmp_path) -> None:
    """The real worker (``TierStore`` on the CPU, a real ``DiskKVStore``) given the plan above: a
    delete and a write of one key. The file must exist afterwards and hold the new page."""
    import torch

    from radixrelay.attention import KVCache
    from radixrelay.radix.disk_store import DiskKVStore
    from radixrelay.worker.kv_tiers import TierStore

    kv = KVCache(num_layers=2, num_pages=4, page_size=PAGE_SIZE, num_kv_heads=1, head_dim=4,
                 dtype=torch.float32, device="cpu")
    for i, t in enumerate(kv.k + kv.v):
        t.copy_(torch.arange(t.numel(), dtype=torch.float32).reshape(t.shape) + 1000 * i)
    disk = DiskKVStore(tmp_path, "ns")
    store = TierStore(kv, host_pages=2, disk=disk)
    key = b"A" * 16
    store.apply(0, KVTransfers(saves=[(1, 0)], disk_writes=[(0, key)]))    # page 1 -> slot 0 -> disk
    assert store.acks(wait=True).written == [key]
    store.apply(1, KVTransfers(saves=[(2, 1)]))                             # page 2 -> slot 1
    store.acks(wait=True)
    store.apply(2, KVTransfers(disk_writes=[(1, key)], disk_deletes=[key]))  # trimmed, then saved again
    assert store.acks(wait=True).written == [key]
    assert disk.read_into(key, bytearray(store.page_bytes)), "the key's file was deleted after its write"
    store.apply(3, KVTransfers(disk_reads=[(key, 0)]))                      # back into slot 0 ...
    assert store.acks(wait=True).read == [key]
    store.apply(4, KVTransfers(loads=[(0, 3)]))                             # ... and onto page 3
    store.acks(wait=True)
    for layer in range(kv.num_layers):
        for cache in (kv.k[layer], kv.v[layer]):
            rows = slice(3 * PAGE_SIZE, 4 * PAGE_SIZE)
            assert torch.equal(cache[rows], cache[2 * PAGE_SIZE:3 * PAGE_SIZE]), "not page 2's KV"
    store.close()


@pytest.mark.parametrize("policy", [
    pytest.param("lru"),
    "scheduler"])
def test_disk_prefixes_of_a_window_larger_than_host_memory(policy: str) -> None:
    """Three queued requests (look-ahead window 32) whose prefixes are on disk only: 3, 2 and 2
    pages, host memory 4 pages. Each fits host memory alone, together they do not; every request
    must still be admitted."""
    prompts = [[100 + i for i in range(13)], [200 + i for i in range(9)], [300 + i for i in range(9)]]
    keys = [extend_keys([], chain_seed(NAMESPACE, None), p, PAGE_SIZE, (len(p) - 1) // PAGE_SIZE) for p in prompts]
    cfg = SchedulerConfig(kv_cache_tokens=24 * PAGE_SIZE, page_size=PAGE_SIZE, kv_namespace=NAMESPACE)
    tiers = KVTiers(host_pages=4, disk_pages=30, disk_keys=[k for ks in keys for k in ks], policy=policy)
    sched = Scheduler(cfg, tiers=tiers)
    worker = TierWorker(PAGE_SIZE, cfg.num_pages, 4, random.Random(0), dict.fromkeys(range(3)),
                        {rid: list(p) for rid, p in enumerate(prompts)})
    worker.disk = {k: page_content(None, p, i, PAGE_SIZE) for p, ks in zip(prompts, keys) for i, k in enumerate(ks)}
    for rid, prompt in enumerate(prompts):
        sched.add_request(rid, prompt, SamplingParams(max_tokens=1))
    for _ in range(100):
        if not sched.has_work():
            break
        plan = sched.schedule()
        out = worker.step(plan)
        acks = worker.collect_acks(wait=not (plan.extends or plan.decodes))
        sched.process_output(msgspec.structs.replace(out, kv_acks=acks))
        sched.check_integrity()
    assert not sched.has_work(), f"requests never admitted ({worker.counts['reads']} disk reads)"


@pytest.mark.parametrize("policy", [
    pytest.param("scheduler"),
    "lru"])
def test_protection_ends_with_the_window(policy: str) -> None:
    """Request D (4 pages) runs alone and fills host memory (4 slots) with its pages; then request
    S arrives, whose 2 pages are on disk. D is long gone, so its pages must not be protected any
    more: S's pages are read into host memory and promoted (8 tokens from disk)."""
    prompts = {0: [1, 2, 3, 4] * 4 + [5], 1: [9] * 9}
    keys = extend_keys([], chain_seed(NAMESPACE, None), prompts[1], PAGE_SIZE, 2)
    cfg = SchedulerConfig(kv_cache_tokens=24 * PAGE_SIZE, page_size=PAGE_SIZE, kv_namespace=NAMESPACE,
                          disk_min_tokens=0)         # a two-page run of 4-token pages: read all the same
    sched = Scheduler(cfg, tiers=KVTiers(host_pages=4, disk_pages=30, disk_keys=keys, policy=policy))
    worker = TierWorker(PAGE_SIZE, cfg.num_pages, 4, random.Random(0), dict.fromkeys(prompts),
                        {rid: list(p) for rid, p in prompts.items()})
    worker.disk = {k: page_content(None, prompts[1], i, PAGE_SIZE) for i, k in enumerate(keys)}
    finals: dict[int, RequestUpdate] = {}
    for rid, prompt in prompts.items():
        sched.add_request(rid, prompt, SamplingParams(max_tokens=1))
        while sched.has_work():
            plan = sched.schedule()
            out = worker.step(plan)
            acks = worker.collect_acks(wait=not (plan.extends or plan.decodes))
            finals.update((u.rid, u) for u in sched.process_output(msgspec.structs.replace(out, kv_acks=acks))
                          if u.finished)
        if rid == 0:
            assert sched.cache.tiers.store.num_host_entries == 4
    assert finals[1].cached_tokens == 2 * PAGE_SIZE
    assert sched.stats().tier_disk_hit_tokens == 2 * PAGE_SIZE


def test_saved_keys_are_kept_on_tree_nodes() -> None:
    """A save reads the keys of a cached prefix off the tree nodes (computed once, split with them),
    and they are the chained keys of the tokens: a second request sharing part of the first one's path
    (its finish splits the first one's node) saves under the same keys the tokens give."""
    cfg = SchedulerConfig(kv_cache_tokens=64 * PAGE_SIZE, page_size=PAGE_SIZE, kv_namespace=NAMESPACE)
    sched = Scheduler(cfg, tiers=KVTiers(host_pages=64))
    first = [7] * (3 * PAGE_SIZE) + [8] * (3 * PAGE_SIZE) + [1]
    second = [7] * (3 * PAGE_SIZE) + [9] * (2 * PAGE_SIZE) + [1]
    for rid, prompt in enumerate((first, second)):
        sched.add_request(rid, prompt, SamplingParams(max_tokens=1))
        plan = sched.schedule()
        sched.process_output(StepOutput(plan.step_id, [rid], [2]))
        plan = sched.schedule()                     # carries the saves
        assert plan.transfers is not None and plan.transfers.saves
        sched.process_output(StepOutput(plan.step_id, [], [], kv_acks=KVAcks(saved_steps=[plan.step_id])))
    seed = chain_seed(NAMESPACE, None)
    tree = sched.cache.tree
    for prompt in (first, second):
        node = tree.match_prefix(prompt, length=len(prompt) // PAGE_SIZE * PAGE_SIZE).node
        kept = [k for n in tree.path(node) for k in n.page_keys]
        assert kept == extend_keys([], seed, prompt, PAGE_SIZE, len(prompt) // PAGE_SIZE)
        assert all(sched.cache.tiers.store.host_state(k) is not None for k in kept)
    assert tree.splits >= 1
    # a waiting request's keys (lpm's host hint, promotion) start from the nodes' keys, then its own tokens
    third = second[:4 * PAGE_SIZE] + [5] * (2 * PAGE_SIZE) + [1]
    sched.add_request(2, third, SamplingParams(max_tokens=1))
    req = sched._waiting[-1]
    assert sched.cache.tiers.page_keys(req, 6) == extend_keys([], seed, third, PAGE_SIZE, 6)
