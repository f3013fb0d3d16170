"""Admission, chunked prefill, prefix reuse, salts, config and API validation."""

from __future__ import annotations

import pytest

from radixrelay.sampling_params import SamplingParams
from radixrelay.scheduler import Scheduler, SchedulerConfig
from tests.scheduler.fake_worker import FakeWorker, Run, collect, default_token_fn, drive


def make(page_size=4, kv_tokens=256, **kw):
    cfg = SchedulerConfig(kv_cache_tokens=kv_tokens, page_size=page_size, **kw)
    return Scheduler(cfg), FakeWorker(page_size, cfg.num_pages)


def expected_outputs(rid, prompt, n):
    toks = list(prompt)
    for _ in range(n):
        toks.append(default_token_fn(rid, toks))
    return toks[len(prompt):]


def test_single_request_exact_tokens_pages_and_cache():
    sched, worker = make(page_size=4)
    prompt = list(range(10))
    sched.add_request(1, prompt, SamplingParams(max_tokens=5))
    plan = sched.schedule()
    assert plan is not None
    assert [a.pages for a in plan.admitted] == [[0, 1, 2]]      # 10 tokens -> 3 pages
    assert [(e.start, e.num_tokens, e.sample) for e in plan.extends] == [(0, 10, True)]
    run = drive_from(sched, worker, plan)
    assert run.tokens[1] == expected_outputs(1, prompt, 5)
    final = run.finals[1]
    assert (final.finish_reason, final.prompt_tokens, final.completion_tokens) == ("length", 10, 5)
    # prompt + 4 fed outputs = 14 computed positions -> 3 whole pages cached, the 4th page freed
    assert sched.stats().cached_tokens == 12
    assert sched.cache.allocator.num_free == sched.config.num_pages - 3
    assert worker.plans[-1].decodes == [1] and sched.schedule() is None
    # the release of a finished request rides on the next plan
    sched.add_request(2, [50], SamplingParams(max_tokens=1))
    plan = sched.schedule()
    assert plan is not None and plan.released == [1]


def drive_from(sched, worker, plan):
    from tests.scheduler.fake_worker import Run, collect
    run = Run()
    collect(run, sched.process_output(worker.step(plan)))
    sched.check_integrity()
    return drive(sched, worker, run)


def test_prefix_reuse_and_multi_turn():
    sched, worker = make(page_size=4)
    prompt = list(range(20))
    sched.add_request(1, prompt, SamplingParams(max_tokens=6))
    first = drive(sched, worker)
    # second request, same prompt: everything but the last (partial page / last token) is cached
    sched.add_request(2, prompt + [7], SamplingParams(max_tokens=2))
    plan = sched.schedule()
    assert plan is not None
    adm = plan.admitted[0]
    assert adm.pages[:5] == worker.plans[0].admitted[0].pages[:5]
    assert plan.extends[0].start == 20
    drive_from(sched, worker, plan)
    # next chat turn: previous prompt + answer + new user tokens
    turn2 = prompt + first.tokens[1] + [1, 2, 3]
    sched.add_request(3, turn2, SamplingParams(max_tokens=2))
    run = drive(sched, worker)
    assert run.finals[3].cached_tokens == 24    # 20 prompt + 5 fed outputs = 25 -> 6 pages
    stats = sched.stats()
    assert stats.cache_hit_tokens == 20 + 24 and stats.prompt_tokens == 20 + 21 + 29


def test_chunked_prefill_mixes_with_decode():
    sched, worker = make(page_size=4, chunked_prefill_tokens=8)
    sched.add_request(1, [1, 2, 3], SamplingParams(max_tokens=10))
    sched.add_request(2, list(range(100, 120)), SamplingParams(max_tokens=2))
    shapes = []
    while sched.has_work():
        plan = sched.schedule()
        assert plan is not None
        assert sum(e.num_tokens for e in plan.extends) + len(plan.decodes) <= 8
        shapes.append(([(e.rid, e.start, e.num_tokens, e.sample) for e in plan.extends],
                       plan.decodes))
        sched.process_output(worker.step(plan))
        sched.check_integrity()
    assert shapes[:5] == [
        ([(1, 0, 3, True), (2, 0, 5, False)], []),
        ([(2, 5, 7, False)], [1]),
        ([(2, 12, 7, False)], [1]),
        ([(2, 19, 1, True)], [1]),
        ([], [1, 2]),
    ]


def test_max_running_requests_and_fcfs():
    sched, worker = make(max_running_requests=2, schedule_policy="fcfs")
    for rid in range(4):
        sched.add_request(rid, [rid + 1] * 3, SamplingParams(max_tokens=3))
    plan = sched.schedule()
    assert plan is not None and [a.rid for a in plan.admitted] == [0, 1]
    sched.process_output(worker.step(plan))
    assert sched.stats().num_running == 2 and sched.stats().num_waiting == 2
    run = drive(sched, worker)
    assert sorted(run.finals) == [0, 1, 2, 3]


def test_salts_never_share():
    sched, worker = make(page_size=2)
    prompt = list(range(9))
    sched.add_request(1, prompt, SamplingParams(max_tokens=2), cache_salt="alice")
    drive(sched, worker)
    sched.add_request(2, prompt, SamplingParams(max_tokens=2), cache_salt="bob")
    sched.add_request(3, prompt, SamplingParams(max_tokens=2))
    sched.add_request(4, prompt, SamplingParams(max_tokens=2), cache_salt="alice")
    run = drive(sched, worker)
    assert {rid: u.cached_tokens for rid, u in run.finals.items()} == {2: 0, 3: 0, 4: 8}


def test_disable_radix_cache():
    sched, worker = make(disable_radix_cache=True)
    for rid in (1, 2):
        sched.add_request(rid, list(range(30)), SamplingParams(max_tokens=3))
        run = drive(sched, worker)
        assert run.finals[rid].cached_tokens == 0
    assert sched.stats().cached_tokens == 0
    assert sched.cache.allocator.num_free == sched.config.num_pages


def test_validation():
    with pytest.raises(ValueError, match="page_size"):
        SchedulerConfig(kv_cache_tokens=64, page_size=0)
    with pytest.raises(ValueError, match="kv_cache_tokens"):
        SchedulerConfig(kv_cache_tokens=8, page_size=16)
    with pytest.raises(ValueError, match="schedule_policy"):
        SchedulerConfig(kv_cache_tokens=64, schedule_policy="random")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="decode_reservation_ratio"):
        SchedulerConfig(kv_cache_tokens=64, decode_reservation_ratio=2.0)
    sched, _ = make(page_size=4, kv_tokens=32)
    with pytest.raises(ValueError, match="needs 9 KV pages"):
        sched.add_request(1, [1] * 30, SamplingParams(max_tokens=4))
    sched.add_request(1, [1] * 29, SamplingParams(max_tokens=4))    # 32 positions: fits exactly
    with pytest.raises(ValueError, match="already live"):
        sched.add_request(1, [1], SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(2, [], SamplingParams())
    with pytest.raises(ValueError, match="detokenize"):
        sched.add_request(3, [1], SamplingParams(stop=("x",)))


def test_worker_error_aborts_the_batch():
    sched, worker = make()
    worker.error_at_step = 1
    sched.add_request(1, [1, 2, 3], SamplingParams(max_tokens=5))
    sched.add_request(2, [4, 5, 6], SamplingParams(max_tokens=5))
    run = drive(sched, worker)
    assert {u.finish_reason for u in run.finals.values()} == {"abort"}
    assert all(u.error == "boom" for u in run.finals.values())
    assert sched.stats().cached_tokens == 0


def test_no_gpu_imports():
    """The radix tree, allocator and scheduler import nothing outside this allow-list; the scheduler's
    process loop (its sockets, tokenizer, cascade planner) imports neither torch nor triton."""
    import ast
    import pathlib
    import subprocess
    import sys

    import radixrelay.radix
    import radixrelay.scheduler

    allowed = ("radixrelay.radix", "radixrelay.scheduler", "radixrelay.sampling_params",
               "radixrelay.protocol", "msgspec", "numpy", "__future__")    # numpy: CPU arrays of token ids
    loaded = subprocess.run([sys.executable, "-c", "import sys, radixrelay.scheduler.scheduler_process; "
                             "print(sorted({'torch', 'triton'} & set(sys.modules)))"],
                            capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]"
    for pkg in (radixrelay.radix, radixrelay.scheduler):
        for path in pathlib.Path(pkg.__path__[0]).glob("*.py"):
            if path.name == "scheduler_process.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                else:
                    continue
                for name in names:
                    stdlib = name.split(".")[0] in sys.stdlib_module_names
                    assert stdlib or name.startswith(allowed), f"{path.name} imports {name}"


def test_concurrent_identical_prompts_compute_the_prefix_once():
    sched, worker = make(page_size=2, kv_tokens=40)
    prompt = list(range(9))
    sched.add_request(1, prompt, SamplingParams(max_tokens=3))
    sched.add_request(2, prompt, SamplingParams(max_tokens=3))
    plan = sched.schedule()
    # rid 2 would compute the same pages as rid 1: it waits for rid 1's prefill
    assert plan is not None and [a.rid for a in plan.admitted] == [1]
    assert [a.pages for a in plan.admitted] == [[0, 1, 2, 3, 4]]
    sched.process_output(worker.step(plan))
    sched.check_integrity()
    # rid 1's 4 whole prompt pages entered the tree when its prefill ended; its partial page is its own
    assert sorted(p for n in sched.cache.tree.nodes() for p in n.pages) == [0, 1, 2, 3]
    plan = sched.schedule()
    assert plan is not None and [a.rid for a in plan.admitted] == [2]
    assert plan.admitted[0].pages[:4] == [0, 1, 2, 3]          # the same KV, shared
    run = Run()
    collect(run, sched.process_output(worker.step(plan)))
    drive(sched, worker, run)
    assert run.finals[2].cached_tokens == 8 and run.finals[2].finish_reason == "length"


def test_identical_prompts_leaving_a_cached_page_mid_page_compute_their_pages_once():
    """Two identical prompts that reuse a partial page of a cached one: the second still waits for the
    first's prefill (the key of the page being computed is page-aligned, not at the copy's end)."""
    sched, worker = make(page_size=4, kv_tokens=128)
    sched.add_request(1, list(range(100, 112)), SamplingParams(max_tokens=2))
    drive(sched, worker)                               # caches [100 .. 111]: 3 pages
    prompt = list(range(100, 106)) + list(range(7, 19))   # 6 shared (2 of page 1), then 3 more pages
    sched.add_request(2, prompt, SamplingParams(max_tokens=2))
    sched.add_request(3, prompt, SamplingParams(max_tokens=2))
    plan = sched.schedule()
    assert [a.rid for a in plan.admitted] == [2] and len(plan.page_copies) == 1
    run = Run()
    collect(run, sched.process_output(worker.step(plan)))
    drive(sched, worker, run)
    assert run.finals[2].cached_tokens == 6 and run.finals[3].cached_tokens == 16
    sched.check_integrity()


def test_shifted_prefix_must_be_whole_pages_inside_the_prompt():
    """A truncated prompt's shifted prefix (radix/truncation.py) that is not whole pages, or sits
    outside the prompt, is refused with a message instead of corrupting page keys later."""
    sched = Scheduler(SchedulerConfig(kv_cache_tokens=256, page_size=4))
    sp = SamplingParams(max_tokens=1)
    for prefix, at in (([1, 2, 3], 4), ([1] * 4, 2), ([1] * 4, 8)):
        with pytest.raises(ValueError, match="whole pages"):
            sched.add_request(0, [5] * 8, sp, shifted_prefix=prefix, shifted_at=at)
    sched.add_request(0, [5] * 8, sp, shifted_prefix=[1] * 4, shifted_at=4)
    assert sched.has_work()


def test_deferred_release_keeps_the_kv_until_release_finished():
    """``process_output(defer_release=True)`` (the runtime loop: updates are sent first) returns the final
    update while the finished request still holds its pages; ``release_finished`` then gives them back,
    into the tree, and names the request for the worker's next plan, as a plain ``process_output`` does."""
    sched, worker = make(page_size=4)
    sched.add_request(1, list(range(10)), SamplingParams(max_tokens=1))
    plan = sched.schedule()
    updates = sched.process_output(worker.step(plan), defer_release=True)
    assert [(u.rid, u.finished) for u in updates] == [(1, True)]
    assert sched.cache.allocator.num_free == sched.config.num_pages - 3      # its partial third page: held
    assert sched.cache.tree.locked_tokens == 8                             # its cached prefix: still locked
    sched.release_finished()
    assert sched.cache.allocator.num_free == sched.config.num_pages - 2
    assert (sched.stats().cached_tokens, sched.cache.tree.locked_tokens) == (8, 0)
    sched.check_integrity()
    sched.add_request(2, list(range(10)), SamplingParams(max_tokens=1))
    assert sched.schedule().released == [1]                               # the next plan drops it


def test_stage_times_count_each_request_once_in_the_queue_and_each_admission_try_in_match():
    cfg = SchedulerConfig(kv_cache_tokens=64, page_size=4, max_running_requests=1)
    sched, worker = Scheduler(cfg), FakeWorker(4, cfg.num_pages)
    assert sched.stats().stage_counts == {"match": 0, "queue": 0}
    for rid in range(3):
        sched.add_request(rid, [1, 2, 3, 4, 5, rid], SamplingParams(max_tokens=2))
    drive(sched, worker)
    stats = sched.stats()
    assert stats.stage_counts["queue"] == 3                  # one per request, at its first admission
    assert stats.stage_counts["match"] >= 3                  # one per try (one running at a time)
    assert all(s >= 0.0 for s in stats.stage_seconds.values()) and set(stats.stage_seconds) == {"match", "queue"}


def test_a_burst_over_a_long_cached_prefix_sends_its_pages_once():
    """Requests admitted in one plan that lock the same cached node of at least ``SHARED_PAGES_BY_REF``
    pages: the first carries the whole page list, the others name it (``pages_from``) and carry their own
    pages only; the lists they stand for are exactly the requests' holds, and the outputs are exact."""
    from radixrelay.scheduler.scheduler import SHARED_PAGES_BY_REF

    sched, worker = make(page_size=2, kv_tokens=1024)
    doc = [(7 * i) % 97 for i in range(2 * SHARED_PAGES_BY_REF + 10)]
    sched.add_request(1, doc, SamplingParams(max_tokens=1))
    drive(sched, worker)
    prompts = {rid: doc + [rid, rid + 1, rid + 2] for rid in range(2, 8)}
    for rid, prompt in prompts.items():
        sched.add_request(rid, prompt, SamplingParams(max_tokens=3))
    plan = sched.schedule()
    assert plan is not None and [a.rid for a in plan.admitted] == list(prompts)
    first, *rest = plan.admitted
    assert first.pages_from == -1 and len(first.pages) >= SHARED_PAGES_BY_REF
    holds = {rid: list(sched._running[rid].hold.pages) for rid in prompts}
    assert first.pages == holds[2]
    for adm in rest:
        assert adm.pages_from == 2 and adm.pages_shared >= SHARED_PAGES_BY_REF
        assert len(adm.pages) == len(holds[adm.rid]) - adm.pages_shared
        assert adm.page_list({2: first.pages}.__getitem__) == holds[adm.rid]
    run = drive_from(sched, worker, plan)
    for rid, prompt in prompts.items():
        assert run.tokens[rid] == expected_outputs(rid, prompt, 3)


def test_questions_locking_different_children_of_a_document_share_its_pages():
    """Each question's last cached page differs (a document whose last token merges with the question's
    first, cached from earlier turns): the admissions of one plan lock different one-page children of
    the document's node, and still take the document's pages by reference from the first of them
    (``pages_from``, ``pages_shared`` = the document's pages); the page lists are the holds, outputs exact."""
    from radixrelay.scheduler.scheduler import SHARED_PAGES_BY_REF

    sched, worker = make(page_size=2, kv_tokens=2048)
    doc = [(7 * i) % 97 for i in range(2 * SHARED_PAGES_BY_REF + 10)]       # a whole number of pages
    tails = {rid: [200 + rid, 300 + rid] for rid in range(2, 8)}             # each question's own last page
    for rid, tail in tails.items():                                         # cached: doc + tail, whole pages
        sched.add_request(100 + rid, doc + tail + [1, 2], SamplingParams(max_tokens=1))
        drive(sched, worker)
    prompts = {rid: doc + tail + [rid, rid + 1, rid + 2] for rid, tail in tails.items()}
    for rid, prompt in prompts.items():
        sched.add_request(rid, prompt, SamplingParams(max_tokens=3))
    plan = sched.schedule()
    assert plan is not None and [a.rid for a in plan.admitted] == list(prompts)
    locks = {sched._running[rid].hold.lock_node for rid in prompts}
    assert len(locks) == len(prompts)                                       # six different lock nodes
    first, *rest = plan.admitted
    holds = {rid: list(sched._running[rid].hold.pages) for rid in prompts}
    assert first.pages_from == -1 and first.pages == holds[2]
    for adm in rest:
        assert adm.pages_from == 2 and adm.pages_shared == len(doc) // 2
        assert adm.page_list({2: first.pages}.__getitem__) == holds[adm.rid]
    run = drive_from(sched, worker, plan)
    for rid, prompt in prompts.items():
        assert run.tokens[rid] == expected_outputs(rid, prompt, 3)


def test_short_shared_prefixes_are_sent_whole():
    sched, worker = make(page_size=4)
    doc = list(range(40))
    sched.add_request(1, doc, SamplingParams(max_tokens=1))
    drive(sched, worker)
    for rid in (2, 3):
        sched.add_request(rid, doc + [rid], SamplingParams(max_tokens=1))
    plan = sched.schedule()
    assert plan is not None and [a.pages_from for a in plan.admitted] == [-1, -1]


def test_a_prompt_leaving_a_cached_page_mid_page_copies_its_leading_tokens():
    """The match is page-granular; the tokens of the next cached page that a prompt shares are copied
    (``StepPlan.page_copies``) and counted as cached, the page's node stays locked (never evicted,
    loaded into or reused) until the step that copies from it is processed, and the fake worker checks
    every position's KV when it computes past them."""
    sched, worker = make(page_size=4, kv_tokens=64)
    doc = list(range(100, 110))
    sched.add_request(1, doc, SamplingParams(max_tokens=4))
    drive(sched, worker)
    assert sched.stats().cached_tokens == 12         # 10 prompt + 3 fed outputs: 3 whole pages
    prompt = doc[:6] + [7, 7, 7]                     # shares page 0 whole and 2 tokens of page 1
    sched.add_request(2, prompt, SamplingParams(max_tokens=2))
    plan = sched.schedule()
    source = worker.plans[0].admitted[0].pages[1]
    (copy,) = plan.page_copies
    assert copy == (source, plan.admitted[0].pages[1], 2)
    assert [(e.start, e.num_tokens) for e in plan.extends] == [(6, 3)]
    node = sched.cache.tree.match_prefix(doc, length=8).node
    assert node.lock_ref == 1                         # the copy's source, held while the step is in flight
    run = Run()
    collect(run, sched.process_output(worker.step(plan)))
    assert node.lock_ref == 0
    drive(sched, worker, run)
    assert run.finals[2].cached_tokens == 6 and sched.cache.partial_page_tokens == 2
    assert run.tokens[2] == expected_outputs(2, prompt, 2)
    sched.check_integrity()
