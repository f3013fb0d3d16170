"""KV audit: who holds the KV pages and radix locks right now, and whether the cache's invariants hold.

The holder counts are cheap enough to run on every /metrics scrape: O(tree nodes + running requests).
``check_integrity`` walks every page and every host-tier entry (memory-bound: O(pages)),
so while requests are live a caller runs it at most every so often and reports the last verdict with
its age (``integrity_age_s``); at idle it runs on every call (``radixrelay.scheduler.paced_audit``).

Idle baseline: once no request is live (none running, none waiting), every page is either free or
cached in the radix tree and nothing is locked:

    request_pages == 0, locked_nodes == 0, lock_refs == 0, lock_holders == 0,
    free_pages + cached_pages == total_pages, integrity_error is None.

Cached pages may stay (the radix cache keeps prefixes for later requests); they are unlocked and
therefore evictable, but for pinned prefixes (``scheduler/pins.py``), whose locks are counted apart
(``pin_refs``) and stay until their pins end. A client checks the baseline after its traffic ends (``at_idle_baseline``);
anything else is a leak of pages or locks.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from radixrelay.protocol.stats import KVAudit
from radixrelay.scheduler.cache import CacheManager
from radixrelay.scheduler.request import Request


def audit_kv(cache: CacheManager, running: Collection[Request], live_requests: int,
             check_integrity: Callable[[], None] | None) -> KVAudit:
    """Count holders independently of each other (so that a leak shows as a mismatch, not as a
    derived zero), then run ``check_integrity`` (None: not now; the caller fills in an earlier
    verdict); its AssertionError becomes ``integrity_error``."""
    locked_nodes = lock_refs = cached_pages = pin_refs = 0
    for node in cache.tree.nodes():
        cached_pages += len(node.pages)
        held = node.lock_ref - node.pin_ref
        pin_refs += node.pin_ref
        if held > 0:
            locked_nodes += 1
            lock_refs += held
    error = None
    try:
        if check_integrity is not None:
            check_integrity()
    except AssertionError as exc:
        error = str(exc) or "AssertionError"
    return KVAudit(
        total_pages=cache.allocator.num_pages, free_pages=cache.num_free_pages,
        cached_pages=cached_pages, request_pages=sum(len(r.hold.own_pages) for r in running),
        locked_nodes=locked_nodes, lock_refs=lock_refs,
        lock_holders=sum(r.hold.holds_locks for r in running), live_requests=live_requests,
        integrity_error=error, pin_refs=pin_refs)
