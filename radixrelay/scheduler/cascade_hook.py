"""The cascade planner's view of a decode batch: each decode row with its path of radix nodes
(``DecodeRow``, ``PathSegment``: ``radixrelay.protocol.cascade`` states what a path covers)."""

from __future__ import annotations

from collections.abc import Callable

from radixrelay.protocol.cascade import DecodeRow, PathSegment
from radixrelay.radix.tree import RadixTree
from radixrelay.scheduler.request import Request

CascadePlanner = Callable[[list[DecodeRow]], object]


def decode_rows(tree: RadixTree, decodes: list[Request]) -> list[DecodeRow]:
    """O(rows) per step: a request's path is rebuilt only when its lock moved or the tree split a
    node (which renumbers the upper part); otherwise the last one is reused."""
    rows = []
    for req in decodes:
        key = (req.lock_node if not req.modules else tuple(req.module_nodes), tree.splits)
        if req.path_key != key:
            req.path_key, req.path = key, _path(tree, req)
        rows.append(DecodeRow(req.rid, req.path, req.kv_len + 1))   # kv_len: the position fed now
    return rows


def _path(tree: RadixTree, req: Request) -> list[PathSegment]:
    """A modular request's path is its spans' paths one after the other (a span shared by rows that place
    it after the same spans is a shared node for them)."""
    path: list[PathSegment] = []
    start = 0
    for end in [req.lock_node] if req.lock_node is not None else req.module_nodes:
        for node in tree.path(end):
            path.append(PathSegment(node.node_id, start, len(node.key)))
            start += len(node.key)
    return path
