"""The cascade planner as the scheduler holds it: each step's decode rows with their radix paths
(``DecodeRow``, ``PathSegment``: ``radixrelay.protocol.cascade`` states what a path covers), and the
per-request path cache the rows are built from."""

from __future__ import annotations

from collections.abc import Callable

from radixrelay.protocol.cascade import DecodeRow, PathSegment
from radixrelay.radix.tree import RadixTree
from radixrelay.scheduler.request import Request

CascadePlanner = Callable[[list[DecodeRow]], object]

# rid -> (key, path): the path (root first) of the request's locked tree path(s), valid while the key
# (its locked node(s), the tree's split count) holds
PathCache = dict[int, tuple[tuple[object, int], list[PathSegment]]]


class CascadeHook:
    """``planner`` with its path cache. An entry lives from the request's first decode row until it
    leaves the running set (finish, abort, retraction: ``forget``)."""

    def __init__(self, planner: CascadePlanner) -> None:
        self.planner = planner
        self._paths: PathCache = {}

    def plan(self, tree: RadixTree, decodes: list[Request]) -> object:
        """The planner's result for this step's decode batch (``StepPlan.cascade``)."""
        return self.planner(decode_rows(tree, decodes, self._paths))

    def forget(self, rid: int) -> None:
        self._paths.pop(rid, None)


def decode_rows(tree: RadixTree, decodes: list[Request], paths: PathCache | None = None) -> list[DecodeRow]:
    """O(rows) per step: a request's path is rebuilt only when its lock moved or the tree split a
    node (which renumbers the upper part); otherwise the one in ``paths`` is reused."""
    if paths is None:
        paths = {}
    rows = []
    for req in decodes:
        hold = req.hold
        key = (hold.lock_node if not req.modules else tuple(hold.module_nodes), tree.splits)
        cached = paths.get(req.rid)
        if cached is None or cached[0] != key:
            cached = paths[req.rid] = (key, _path(tree, req))
        rows.append(DecodeRow(req.rid, cached[1], hold.kv_len + 1))   # kv_len: the position fed now
    return rows


def _path(tree: RadixTree, req: Request) -> list[PathSegment]:
    """A modular request's path is its spans' paths one after the other (a span shared by rows that place
    it after the same spans is a shared node for them)."""
    path: list[PathSegment] = []
    start = 0
    hold = req.hold
    for end in [hold.lock_node] if hold.lock_node is not None else hold.module_nodes:
        for node in tree.path(end):
            path.append(PathSegment(node.node_id, start, len(node.key)))
            start += len(node.key)
    return path
