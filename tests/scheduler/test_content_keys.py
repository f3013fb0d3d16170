"""Content keys of pages (``scheduler/content_keys.py``) for the KV tiers and the KV events: the same bytes
as before the keys were computed from int32 arrays (the disk tier and the KV events name pages by them),
each page hashed once per request at most and only where a tier or an event asks, salts apart."""

from __future__ import annotations

import array
import hashlib

import numpy as np
import pytest

from radixrelay.radix import page_keys
from radixrelay.radix.tiers import KVTiers
from radixrelay.sampling_params import SamplingParams
from radixrelay.scheduler import Scheduler, SchedulerConfig
from radixrelay.scheduler.tier_coordinator import FIRST_RUN_PAGES
from tests.scheduler.fake_worker import FakeWorker, drive
from tests.scheduler.recording_publisher import RecordingPublisher

PS = 4
NS = "test-model;page_size=4"


def reference_keys(namespace: str, salt: str | None, tokens: list[int], page_size: int, n: int) -> list[bytes]:
    """The key format, written out independently of the code under test: blake2b-128 chained from a
    personalised digest of (namespace, salt), each page's tokens as native int64."""
    seed = hashlib.blake2b(digest_size=16, person=b"radixrelay-ns")
    seed.update(namespace.encode())
    seed.update(b"\x00" if salt is None else b"\x01" + salt.encode())
    prev, keys = seed.digest(), []
    for i in range(n):
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(array.array("q", tokens[i * page_size:(i + 1) * page_size]).tobytes())
        prev = h.digest()
        keys.append(prev)
    return keys


@pytest.fixture
def blake2b_calls(monkeypatch):
    """Pages hashed (blake2b-128 digests of page keys, the namespace seeds left out)."""
    calls = []
    real = hashlib.blake2b

    def counting(*args, **kwargs):
        if "person" not in kwargs:
            calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(page_keys.hashlib, "blake2b", counting)
    return calls


@pytest.mark.parametrize("salt", [None, "", "tenant-a"])
def test_keys_are_the_format_on_disk_and_on_the_wire(salt):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 2**31 - 1, 10 * PS + 3).tolist()
    want = reference_keys(NS, salt, tokens, PS, 10)
    seed = page_keys.chain_seed(NS, salt)
    assert page_keys.extend_keys([], seed, tokens, PS, 10) == want                            # a list
    assert page_keys.extend_keys([], seed, np.array(tokens, dtype=np.int32), PS, 10) == want  # an array
    assert page_keys.extend_keys(want[:4], seed, np.array(tokens, dtype=np.int32), PS, 10) == want
    sched = Scheduler(SchedulerConfig(kv_cache_tokens=64 * PS, page_size=PS, kv_namespace=NS), tiers=KVTiers(64))
    sched.add_request(1, tokens, SamplingParams(max_tokens=1), cache_salt=salt)
    req = sched._requests[1]
    assert sched.cache.keys.of(req, 10) == want


def test_a_question_over_a_cached_document_hashes_only_its_own_pages(blake2b_calls):
    """Tiers and events on: the document's keys are computed once, when its pages enter the tree; each
    later question hashes its own new pages once, whoever asks (host lookup, save, events)."""
    pub = RecordingPublisher()
    cfg = SchedulerConfig(kv_cache_tokens=512 * PS, page_size=PS, kv_namespace=NS)
    sched = Scheduler(cfg, tiers=KVTiers(512), events=pub)
    worker = FakeWorker(PS, cfg.num_pages)
    doc = list(range(1000, 1000 + 100 * PS))                        # 100 pages
    sched.add_request(0, doc + [1], SamplingParams(max_tokens=1))
    drive(sched, worker)
    assert len(blake2b_calls) == sched.cache.keys.hashed_pages == 100
    for rid in range(1, 6):
        blake2b_calls.clear()
        before = sched.cache.keys.hashed_pages
        question = doc + [rid] * (2 * PS) + [7, 7]                   # 2 new whole pages, then a partial one
        sched.add_request(rid, question, SamplingParams(max_tokens=1))
        drive(sched, worker)
        assert sched._requests.get(rid) is None
        # pages 100 and 101
        assert len(blake2b_calls) == sched.cache.keys.hashed_pages - before == 2, rid
        assert pub.stored_log[-2:] == reference_keys(NS, None, question, PS, 102)[100:]
    assert pub.stored_log[:100] == reference_keys(NS, None, doc, PS, 100)
    assert len(pub.stored_log) == len(set(pub.stored_log)) == 100 + 5 * 2     # each page told once
    sched.check_integrity()


def test_a_host_lookup_for_an_unknown_prompt_hashes_a_few_pages_not_the_prompt(blake2b_calls):
    cfg = SchedulerConfig(kv_cache_tokens=512 * PS, page_size=PS, kv_namespace=NS)
    sched = Scheduler(cfg, tiers=KVTiers(512))
    sched.add_request(0, list(range(300 * PS)), SamplingParams(max_tokens=1))
    plan = sched.schedule()                                          # the admission looks host memory up
    assert plan.admitted and len(blake2b_calls) <= FIRST_RUN_PAGES


def test_pages_found_in_host_memory_are_promoted_with_their_keys_kept_on_the_new_node(blake2b_calls):
    """A document evicted from the device but held by host memory: its pages are found by hashing them
    once (no more than ~4x as many pages asked for as are there), and the node the promotion adds keeps
    those keys, so the next question hashes none of the document's pages again."""
    cfg = SchedulerConfig(kv_cache_tokens=512 * PS, page_size=PS, kv_namespace=NS)
    tiers = KVTiers(512)
    sched, worker = Scheduler(cfg, tiers=tiers), FakeWorker(PS, cfg.num_pages)
    doc = list(range(5000, 5000 + 64 * PS))
    sched.add_request(0, doc + [1], SamplingParams(max_tokens=1))
    drive(sched, worker)
    assert sched.flush_cache()                                       # the device forgets, host memory keeps
    blake2b_calls.clear()
    sched.add_request(1, doc + [2] * PS + [3], SamplingParams(max_tokens=1))
    drive(sched, worker)
    assert sched.stats().tier_host_hit_tokens == 64 * PS
    assert len(blake2b_calls) <= 64 + 1 + FIRST_RUN_PAGES            # the document once, its own page once
    blake2b_calls.clear()
    sched.add_request(2, doc + [4] * PS + [3], SamplingParams(max_tokens=1))
    drive(sched, worker)
    assert len(blake2b_calls) == 1                                   # its own page only
    sched.check_integrity()


def test_kv_events_on_the_wire_are_the_reference_keys_through_eviction_and_salts():
    pub = RecordingPublisher()
    cfg = SchedulerConfig(kv_cache_tokens=24 * PS, page_size=PS, kv_namespace=NS)
    sched, worker = Scheduler(cfg, events=pub), FakeWorker(PS, cfg.num_pages)
    prompts = {1: (list(range(100, 100 + 6 * PS)) + [5], None), 2: (list(range(100, 100 + 6 * PS)) + [5], "s"),
               3: (list(range(900, 900 + 9 * PS)) + [5], None), 4: (list(range(700, 700 + 9 * PS)) + [5], "s")}
    want_stored: list[bytes] = []
    for rid, (tokens, salt) in prompts.items():
        sched.add_request(rid, tokens, SamplingParams(max_tokens=1), cache_salt=salt)
        drive(sched, worker)
        want_stored += reference_keys(NS, salt, tokens, PS, len(tokens) // PS)
    assert pub.stored_log == want_stored
    # the 24-page pool overflowed: what eviction took out is told, by the same keys, from the tail
    assert pub.removed_log and set(pub.removed_log) <= set(want_stored)
    held = {k for k in want_stored if k not in pub.removed_log}
    tree_keys = {k for node in sched.cache.tree.nodes()
                 for k in sched.cache.keys.of_node(node, sched.cache.tree.path(node)[0].parent.salt)[-len(node.pages):]}
    assert tree_keys == held
    # the same tokens under two salts never share a key, nor a tree node
    assert not set(reference_keys(NS, None, prompts[1][0], PS, 6)) & set(reference_keys(NS, "s", prompts[2][0], PS, 6))
