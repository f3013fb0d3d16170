"""KV events of the lower tiers (``scheduler/kv_event_hook.py``, ``KVTiers.take_changes``): a page's key is
told entering the device, host memory and disk, leaving the device and host memory under pressure, and
coming back from disk to host memory and the device, in that order; the first publication is a snapshot of
both tiers (``tier_cleared``, then the keys held), as is the one after the tiers lost track of changes."""

from __future__ import annotations

import random

import msgspec

from radixrelay.radix import tiers as tiers_module
from radixrelay.radix.page_keys import chain_seed, extend_keys
from radixrelay.radix.tiers import KVTiers
from radixrelay.sampling_params import SamplingParams
from radixrelay.scheduler import Scheduler, SchedulerConfig
from tests.radix.test_tiers_state_machine import NAMESPACE, TierWorker
from tests.radix.test_tiers_state_machine import PAGE_SIZE as PS
from tests.scheduler.recording_publisher import RecordingPublisher

PROMPT = list(range(1, 22))                    # 5 whole pages and a token


def _setup(host_pages: int = 8, disk_pages: int = 32):
    publisher = RecordingPublisher()
    config = SchedulerConfig(kv_cache_tokens=12 * PS, page_size=PS, kv_namespace=NAMESPACE, disk_min_tokens=0)
    sched = Scheduler(config, tiers=KVTiers(host_pages=host_pages, disk_pages=disk_pages), events=publisher)
    salts: dict[int, str | None] = {}
    history: dict[int, list[int]] = {}
    worker = TierWorker(PS, config.num_pages, host_pages, random.Random(0), salts, history)
    rids = iter(range(1, 1000))

    def run(prompt: list[int]) -> None:
        rid = next(rids)
        salts[rid], history[rid] = None, list(prompt)
        sched.add_request(rid, prompt, SamplingParams(max_tokens=1))
        for _ in range(200):
            if not sched.has_work() and not sched._tiers_busy():
                return
            plan = sched.schedule()
            if plan is None:
                return
            out = worker.step(plan)
            sched.process_output(msgspec.structs.replace(out, kv_acks=worker.collect_acks(True)))
        raise AssertionError("the scheduler did not finish")

    return sched, publisher, run


def test_a_page_moving_device_host_disk_and_back_is_told_in_order():
    sched, publisher, run = _setup()
    first = extend_keys([], chain_seed(NAMESPACE, None), PROMPT, PS, 1)[0]
    run(PROMPT)
    for base in (100, 200, 300, 400):                    # other prompts push it out of the device and host memory
        run(list(range(base, base + 21)))
    run(PROMPT)                                          # read back from disk
    assert publisher.log[:2] == [("tier_cleared", "host", ()), ("tier_cleared", "disk", ())]
    moves = [(kind, tier) for kind, tier, keys in publisher.log if first in keys]
    assert moves == [("stored", ""), ("tier_stored", "host"), ("tier_stored", "disk"), ("tier_removed", "host"),
                     ("removed", ""), ("tier_stored", "host"), ("stored", "")]
    assert sched.stats().cached_tokens > 0


def test_a_snapshot_follows_changes_the_tiers_lost_track_of(monkeypatch):
    monkeypatch.setattr(tiers_module, "MAX_CHANGES", 3)
    sched, publisher, run = _setup()
    run(PROMPT)                                          # first publication: a snapshot of empty tiers
    publisher.log.clear()
    run(list(range(100, 121)))                           # 5 pages saved at once: more than 3 changes
    host, disk = sched.cache.tiers.store.snapshot()
    snapshot = [entry for entry in publisher.log if entry[0].startswith("tier_")]
    assert snapshot[:2] == [("tier_cleared", "host", ()), ("tier_stored", "host", tuple(host))]
    assert len(host) == 8 and disk                        # every page held, not only the changes


def test_the_devices_pages_are_announced_whole_every_snapshot_period(monkeypatch):
    """``cleared``, then ``stored`` of every page key the tree holds (what the device events told, less what
    eviction removed), at the snapshot period: a router that missed entries catches up."""
    from radixrelay.scheduler import kv_event_hook

    sched, publisher, run = _setup()
    run(PROMPT)
    for base in (100, 200, 300):
        run(list(range(base, base + 21)))
    told: set[bytes] = set()
    for kind, _, keys in publisher.log:
        if kind == "stored":
            told.update(keys)
        elif kind == "removed":
            told.difference_update(keys)
    monkeypatch.setattr(kv_event_hook, "SNAPSHOT_EVERY_S", 0.0)
    publisher.log.clear()
    sched.publish_load()
    assert [kind for kind, _, _ in publisher.log] == ["cleared", "stored"]
    snapshot = publisher.log[1][2]
    assert len(snapshot) == len(set(snapshot)) == sched.cache.tree.cached_tokens // PS
    assert set(snapshot) == told


def test_a_replica_started_over_a_kept_disk_tier_announces_its_pages():
    """Pages found on disk at start-up (``KVTiers(disk_keys=...)``: a restart over the same directory) are
    announced when the scheduler starts, before any request: ``tier_cleared`` then ``tier_stored`` of them."""
    kept = extend_keys([], chain_seed(NAMESPACE, None), PROMPT, PS, 5)
    publisher = RecordingPublisher()
    config = SchedulerConfig(kv_cache_tokens=12 * PS, page_size=PS, kv_namespace=NAMESPACE)
    Scheduler(config, tiers=KVTiers(host_pages=8, disk_pages=32, disk_keys=kept), events=publisher)
    assert publisher.log == [("tier_cleared", "host", ()), ("tier_cleared", "disk", ()),
                             ("tier_stored", "disk", tuple(kept))]
