"""Saves under a long shared prefix cost O(new pages): a save told that its chain's first keys are known
in host memory neither looks them up nor touches them (``KVTiers.save(known=...)``), and the scheduler's
tier coordinator passes what earlier saves found (``TierCoordinator.save``), marking the shared head used
again only once it has aged by a quarter of host memory, so that a document being asked about stays in
host memory under pressure while a question costs no pass over it."""

from __future__ import annotations

from radixrelay.protocol.kv import KVAcks
from radixrelay.protocol.step import StepOutput
from radixrelay.radix.page_keys import chain_seed, extend_keys
from radixrelay.radix.tiers import KVTiers
from radixrelay.sampling_params import SamplingParams
from radixrelay.scheduler import Scheduler, SchedulerConfig

PAGE_SIZE = 4
NAMESPACE = "test-model;page_size=4"


class CountingTiers(KVTiers):
    """Counts the keys ``_touch`` moved (the LRU work a save does) and keeps those evicted."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.touched = 0
        self.dropped_keys: set[bytes] = set()

    def _touch(self, keys: list[bytes]) -> None:
        self.touched += len(keys)
        super()._touch(keys)

    def _drop(self, key: bytes) -> None:
        self.dropped_keys.add(key)
        super()._drop(key)


def test_known_keys_are_neither_looked_up_nor_touched_but_spared():
    tiers = CountingTiers(6, policy="lru")
    head = [b"h0", b"h1", b"h2"]
    tiers.save(head + [b"a0"], [0, 1, 2, 3])
    tiers.on_acks(KVAcks(saved_steps=[0])) if tiers.take(0) else None
    tiers.touched = 0
    assert tiers.save(head + [b"b0"], [0, 1, 2, 4], known=3) == 1
    assert tiers.touched == 1                        # the new page only
    tiers.on_acks(KVAcks(saved_steps=[1])) if tiers.take(1) else None
    # full (5 of 6 used, the next save needs 2): the LRU victims are a0 / b0, never the chain's own head
    assert tiers.save(head + [b"c0", b"c1"], [0, 1, 2, 5, 6], known=3) == 2
    assert all(tiers.host_state(k) is not None for k in head)
    tiers.check_integrity()


def test_epoch_moves_when_a_key_leaves_host_memory():
    tiers = KVTiers(2, policy="lru")
    tiers.save([b"x"], [0])
    before = tiers.epoch
    tiers.on_acks(KVAcks(failed_steps=[0])) if tiers.take(0) else None      # a failed save drops its key
    assert tiers.host_state(b"x") is None and tiers.epoch > before


def _finish_together(sched: Scheduler, prompts: dict[int, list[int]]) -> None:
    """Every prompt prefilled in one step and finished by it (max_tokens 1); then the plan carrying the
    saves, acknowledged."""
    for rid, prompt in prompts.items():
        sched.add_request(rid, prompt, SamplingParams(max_tokens=1))
    plan = sched.schedule()
    assert sorted(item.rid for item in plan.extends) == sorted(prompts)
    sched.process_output(StepOutput(plan.step_id, sorted(prompts), [2] * len(prompts)))
    plan = sched.schedule() or sched.schedule()
    assert plan.transfers is not None and plan.transfers.saves
    sched.process_output(StepOutput(plan.step_id, [], [], kv_acks=KVAcks(saved_steps=[plan.step_id])))


def test_questions_under_one_document_save_their_own_pages_and_touch_it_once():
    cfg = SchedulerConfig(kv_cache_tokens=256 * PAGE_SIZE, page_size=PAGE_SIZE, kv_namespace=NAMESPACE)
    tiers = CountingTiers(host_pages=256)
    sched = Scheduler(cfg, tiers=tiers)
    doc = [7, 8, 9, 10] * (16 * PAGE_SIZE // 4)                     # 16 pages
    _finish_together(sched, {0: doc + [1]})                         # the document: cached, saved
    tiers.touched = 0
    questions = {rid: doc + [rid] * (2 * PAGE_SIZE) + [1] for rid in range(1, 9)}
    _finish_together(sched, questions)
    seed = chain_seed(NAMESPACE, None)
    doc_keys = extend_keys([], seed, doc, PAGE_SIZE, 16)
    for prompt in questions.values():
        assert all(tiers.host_state(k) == "ready" for k in extend_keys([], seed, prompt, PAGE_SIZE, 18))
    # each question touches its own 2 pages (at prefill end and at finish); the document at most once
    # more in all, not once per save (8 questions x 2 saves x 16 pages)
    assert tiers.touched <= 8 * 2 * 2 + 16, tiers.touched
    assert all(tiers.host_state(k) == "ready" for k in doc_keys)
    tiers.check_integrity()


def test_a_document_being_asked_about_stays_in_host_memory_under_pressure():
    """Questions about a 16-page document alternate with unrelated prompts that overflow host memory
    (64 pages) many times over: the unrelated pages are evicted, the document never is, and it is marked
    used a few times in all, not once per question."""
    cfg = SchedulerConfig(kv_cache_tokens=256 * PAGE_SIZE, page_size=PAGE_SIZE, kv_namespace=NAMESPACE)
    tiers = CountingTiers(host_pages=64)
    sched = Scheduler(cfg, tiers=tiers)
    doc = [7, 8, 9, 10] * (16 * PAGE_SIZE // 4)                     # 16 pages
    _finish_together(sched, {0: doc + [1]})
    doc_keys = extend_keys([], chain_seed(NAMESPACE, None), doc, PAGE_SIZE, 16)
    tiers.touched = 0
    rounds = 40
    for i in range(1, rounds + 1):
        _finish_together(sched, {2 * i: doc + [i] * (2 * PAGE_SIZE) + [1],
                                 2 * i + 1: [1000 + i] * (4 * PAGE_SIZE) + [1]})
        assert not tiers.dropped_keys.intersection(doc_keys), f"round {i}: the document was evicted"
    assert tiers.counters.host_evicted >= 3 * 64          # host memory overflowed many times over
    assert all(tiers.host_state(k) == "ready" for k in doc_keys)
    # own pages: (2 + 4) per round, touched at prefill end and at finish; the document every other round
    # at most (marked used once per step with a question, it would be 16 x 2 per round: 1,760 in all)
    assert tiers.touched <= rounds * 6 * 2 + 16 * rounds // 2, tiers.touched
    tiers.check_integrity()
