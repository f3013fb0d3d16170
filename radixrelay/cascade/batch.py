"""Worker side: a step's ``CascadePlan`` (decode rows) and the extend rows' shared cached pages
(prefill) turned into the ``CascadeBatch`` of its ``ForwardBatch``.

Decode: the scheduler's groups name rids; here they become decode-row indices and page runs read from
the first member's page list. The device tensors are kept while the plan and the decode order repeat
(steady decode: the plan object is reused by the planner), so the per-step cost is then one
comparison.

With ``split_pages`` (a backend whose shared-node kernel loads consecutive pages by TMA), a group
whose pages are a few long runs of consecutive ids becomes one run per piece, with the same rows:
exact (the merge takes any number of parts per row), and every piece is then one strided block of the
cache. A node's pages are one run when one prompt allocated them (``PageAllocator``); a chain of nodes
cached by different requests is several.

Prefill (RelayAttention's prompt phase): extend rows whose cached prefixes begin with the same pages
share those pages' KV; the longest common run of cached pages of each such set becomes one shared run
attended once for all their new tokens, if the cost model accepts it (per run, then all runs
together; savings counted per request as in decode, a lower bound for a kernel that re-reads the
prefix per query tile). One level: sets are keyed by their first page. Work is O(cached pages of the extend rows), within the O(new tokens) of an extend.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import chain, compress, repeat
from operator import attrgetter, is_not

from radixrelay.attention.metadata import BatchRequest, SharedRun, SharedRuns, build_shared_runs, consecutive
from radixrelay.cascade.cost import CostModel
from radixrelay.protocol.cascade import CascadePlan

PagesOf = Callable[[int], Sequence[int]]   # rid -> its page list

# A group is split at its page-id breaks only into pieces of at least MIN_PIECE_PAGES pages, at most
# MAX_PIECES of them: each piece adds a partial tail tile (gathered) and one merge part per row
# (heads x head_dim fp32 values per row), small next to the TMA path's gain on a long node but not on
# many short pieces.
MIN_PIECE_PAGES = 32
MAX_PIECES = 8


def split_at_page_breaks(run: SharedRun, page_size: int, min_pages: int = MIN_PIECE_PAGES,
                         max_pieces: int = MAX_PIECES) -> list[SharedRun]:
    """``run`` as pieces of consecutive page ids (the same rows each), or ``[run]`` when it is one
    piece already or the pieces are too short or too many."""
    pages = list(run.pages)
    if consecutive(pages):
        return [run]
    breaks = [i for i in range(1, len(pages)) if pages[i] != pages[i - 1] + 1]
    if len(breaks) + 1 > max_pieces:
        return [run]
    bounds = [0, *breaks, len(pages)]
    if any(hi - lo < min_pages for lo, hi in zip(bounds, bounds[1:])):
        return [run]
    return [SharedRun(run.rows, pages[lo:hi], min(hi * page_size, run.num_tokens) - lo * page_size)
            for lo, hi in zip(bounds, bounds[1:])]


def decode_runs(plan: CascadePlan, decode_rids: Sequence[int], pages_of: PagesOf,
                page_size: int, split_pages: bool = False, min_piece_pages: int = MIN_PIECE_PAGES) -> list[SharedRun]:
    """One run per group (with ``split_pages``: per piece of consecutive pages, see above), rows =
    indices into ``decode_rids``; checks that members hold the run's pages."""
    return _decode_runs(plan, decode_rids, pages_of, page_size, split_pages, min_piece_pages, None)[0]


# (first page, end page) -> [(run pages, {rid: its page list when found to hold them})]: one entry per
# distinct run at those page indices (sibling groups of a level have the same indices, other pages).
_Held = dict[tuple[int, int], list[tuple[list[int], dict[int, Sequence[int]]]]]


def _decode_runs(plan: CascadePlan, decode_rids: Sequence[int], pages_of: PagesOf, page_size: int,
                 split_pages: bool, min_piece_pages: int, held: _Held | None) -> tuple[list[SharedRun], _Held]:
    """``decode_runs``; with ``held`` (from the previous call, valid while every page list only grew and
    none was replaced) a member found to hold a run before, with the same page list, is not compared
    again page by page. Returns the runs and ``held`` for this plan's members."""
    index = dict(zip(decode_rids, range(len(decode_rids))))
    held = held or {}
    runs = []
    now: _Held = {}
    for g in plan.groups:
        lo, hi = g.start // page_size, -(-(g.start + g.num_tokens) // page_size)
        lead = pages_of(g.rids[0])
        known = held.get((lo, hi), ())
        pages, holders = next(((run, by) for run, by in known if by.get(g.rids[0]) is lead), (None, {}))
        if pages is None:
            pages = list(lead[lo:hi])
            holders = next((by for run, by in known if run == pages), {})
        if g.start % page_size or len(pages) != hi - lo:
            raise ValueError(f"cascade group at {g.start}+{g.num_tokens}: not page aligned or past the pages")
        mine = list(map(pages_of, g.rids))
        # members not found holding it before (C-level filter: a changed plan has a few)
        for rid, theirs in compress(zip(g.rids, mine), map(is_not, map(holders.get, g.rids), mine)):
            if theirs[lo:hi] != pages:
                raise ValueError(f"cascade group at {g.start}: request {rid} does not hold the run's pages")
        now.setdefault((lo, hi), []).append((pages, dict(zip(g.rids, mine))))
        # rows ascending: a member that takes a departed member's row leaves the run as it was
        run = SharedRun(sorted(map(index.__getitem__, g.rids)), pages, g.num_tokens)
        runs.extend(split_at_page_breaks(run, page_size, min_piece_pages) if split_pages else [run])
    return runs, now


def prefill_runs(extends: Sequence[BatchRequest], cost: CostModel,
                 page_size: int) -> tuple[list[SharedRun], list[int]]:
    """Shared cached runs of the extend rows: (runs with flat token rows, kv_start per extend row)."""
    by_first: dict[int, list[int]] = {}
    for i, r in enumerate(extends):
        if r.start >= page_size:
            by_first.setdefault(r.pages[0], []).append(i)
    offsets = [0]
    for r in extends:
        offsets.append(offsets[-1] + r.num_new)
    runs, kv_start, saved = [], [0] * len(extends), 0
    for members in by_first.values():
        if len(members) < 2:
            continue
        first = extends[members[0]].pages
        common = min(extends[i].start for i in members) // page_size
        for i in members[1:]:
            common = _common_prefix(first, extends[i].pages, common)
        tokens = common * page_size
        if not cost.worth_group(len(members), tokens):
            continue
        saved += (len(members) - 1) * tokens
        rows = [t for i in members for t in range(offsets[i], offsets[i + 1])]
        runs.append(SharedRun(rows, list(first[:common]), tokens))
        for i in members:
            kv_start[i] = tokens
    if not cost.worth_plan(saved):
        return [], [0] * len(extends)
    return runs, kv_start


# An extend that computes few new tokens after a long cached prefix (a chat turn, a question about a cached
# document) gives the extend kernel one query tile per KV head to read the whole prefix with: a handful of
# programs. Read as a shared run of its own instead, the prefix is split along its length over the GPU
# (the shared-node kernel's split-K) and merged by LSE: exact, and the time to first token no longer grows
# with the cached length. Worth it from LONG_PREFIX_TOKENS cached tokens for up to FEW_NEW_TOKENS new ones.
LONG_PREFIX_TOKENS = 1024
FEW_NEW_TOKENS = 256


def long_prefix_runs(extends: Sequence[BatchRequest], kv_start: list[int], page_size: int,
                     min_prefix: int = LONG_PREFIX_TOKENS, max_new: int = FEW_NEW_TOKENS) -> list[SharedRun]:
    """One run per extend not already reading a shared run (``kv_start`` 0) whose cached whole pages hold at
    least ``min_prefix`` tokens and that computes at most ``max_new``; updates ``kv_start`` for them."""
    runs = []
    row = 0
    for i, r in enumerate(extends):
        tokens = r.start // page_size * page_size
        if kv_start[i] == 0 and tokens >= min_prefix and r.num_new <= max_new:
            runs.append(SharedRun(list(range(row, row + r.num_new)), list(r.pages[:tokens // page_size]), tokens))
            kv_start[i] = tokens
        row += r.num_new
    return runs


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int, chunk: int = 64) -> int:
    """Length of the common prefix of ``a[:limit]`` and ``b[:limit]``: slices compared in C (all at once,
    then by chunks), element by element only inside the first chunk that differs."""
    if a[:limit] == b[:limit]:
        return limit
    n = 0
    while n + chunk < limit and a[n:n + chunk] == b[n:n + chunk]:
        n += chunk
    while n < limit and a[n] == b[n]:
        n += 1
    return n


def shifted_runs(runs: SharedRuns, offset: int) -> list[SharedRun]:
    """The host runs of ``runs`` with every query row moved ``offset`` rows down (decode runs placed after
    a step's extend rows). O(rows + pages)."""
    rows, indptr, pages, kv_indptr = runs.host_rows, runs.host_indptr, runs.host_pages, runs.host_kv_indptr
    return [SharedRun([r + offset for r in rows[indptr[g]:indptr[g + 1]]], pages[kv_indptr[g]:kv_indptr[g + 1]], n)
            for g, n in enumerate(runs.host_kv_lens)]


def _same_runs(runs: Sequence[SharedRun], built: SharedRuns) -> bool:
    """Whether ``runs`` are the runs ``built`` holds (a plan whose members changed but whose rows, pages
    and lengths did not: a request left and another took its row). C-level over rows and pages."""
    return (len(runs) == len(built.host_kv_lens) and all(r.num_tokens == n for r, n in zip(runs, built.host_kv_lens))
            and tuple(chain.from_iterable(map(_ROWS, runs))) == built.host_rows
            and tuple(chain.from_iterable(map(_RUN_PAGES, runs))) == built.host_pages)


_ROWS = attrgetter("rows")
_RUN_PAGES = attrgetter("pages")


class DecodeRunsCache:
    """Device tensors of the last decode plan, reused while (plan, decode order) repeat and none of the
    plan's members left the request table.

    The owner calls ``release(rid)`` whenever ``rid`` leaves its table (finished, retracted, or admitted
    again): page lists only grow while a request is resident, so what was checked of a member stays
    true until then. A rebuild (a new plan or order) then compares each member's run pages once per
    residency, not once per rebuild: O(members) plus O(pages) per member not seen before, instead of
    O(members x pages)."""

    def __init__(self, page_size: int, device, split_pages: bool = False) -> None:
        self.page_size = page_size
        self.device = device
        self.split_pages = split_pages
        self._key: tuple[CascadePlan, tuple[int, ...]] | None = None
        self._runs: SharedRuns | None = None
        self._own: list[int] = []
        self._held: _Held = {}
        self._members: set[int] = set()      # rids of the cached plan's groups
        self.builds = 0          # rebuilds so far (tests, benchmarks)

    def release(self, rid: int) -> None:
        """``rid`` left the request table: forget what was checked of its pages."""
        if rid in self._members:                        # a member of the cached plan
            self._key = None
            for entries in self._held.values():
                for _, holders in entries:
                    holders.pop(rid, None)

    def get(self, plan: CascadePlan, decode_rids: Sequence[int], pages_of: PagesOf) -> SharedRuns | None:
        key = (plan, tuple(decode_rids))
        if key != self._key:
            self._key = None
            runs, self._held = _decode_runs(plan, decode_rids, pages_of, self.page_size, self.split_pages,
                                            MIN_PIECE_PAGES, self._held)
            if self._runs is None or not _same_runs(runs, self._runs):   # else: the same tensors (identity)
                self._runs = build_shared_runs(runs, self.device)
            self._own = list(map(plan.own_start.get, decode_rids, repeat(0)))
            self._members = set().union(*(holders for entries in self._held.values() for _, holders in entries))
            self._key = key
            self.builds += 1
        return self._runs

    @property
    def own_start(self) -> list[int]:
        """Per decode row of the last ``get``: the first position it attends on its own (read-only)."""
        return self._own
