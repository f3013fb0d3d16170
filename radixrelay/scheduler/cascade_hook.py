"""The cascade planner's view of a decode batch: each decode row with its path of radix nodes.

A row's path lists the tree nodes of its locked cached prefix, root first; node ``node_id`` covers
token positions ``[start, start + num_tokens)`` of that row, i.e. its pages
``pages[start // page_size : (start + num_tokens) // page_size]`` (the same page ids in every row
that shares the node). Positions past the path are private to the row. The planner returns an
opaque plan that the scheduler puts into ``StepPlan.cascade``; node ids are stable while the rows
hold their locks, but a node may be split between steps (its upper part gets a new id).
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from radixrelay.radix.tree import RadixTree
from radixrelay.scheduler.request import Request


class PathSegment(msgspec.Struct, frozen=True):
    node_id: int
    start: int                 # first token position of the node within the row
    num_tokens: int


class DecodeRow(msgspec.Struct, frozen=True):
    rid: int
    path: list[PathSegment]    # shared prefix, root first; covers [0, sum of num_tokens)
    seq_len: int               # positions this row attends this step (its KV incl. the new token)


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
