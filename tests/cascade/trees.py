"""Random trees of shared prefixes at the attention level: a paged KV cache holding a random radix tree
(every node a run of whole pages) and requests that decode or extend below random nodes of it."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import torch

from radixrelay.attention import BatchRequest, ForwardBatch, KVCache, build_forward_batch
from radixrelay.attention.metadata import build_shared_runs
from radixrelay.cascade.batch import decode_runs, prefill_runs
from radixrelay.cascade.cost import ALWAYS, CostModel
from radixrelay.cascade.planner import plan_groups
from radixrelay.protocol.cascade import DecodeRow, PathSegment


@dataclass
class Node:
    node_id: int
    parent: Node | None
    tokens: int
    pages: list[int]

    def path(self) -> list[Node]:
        return ([] if self.parent is None else self.parent.path()) + [self]


@dataclass
class Scenario:
    cache: KVCache
    flat: ForwardBatch        # no cascade
    cascaded: ForwardBatch    # the same batch with its cascade plan
    num_groups: int


def random_scenario(rng: random.Random, *, page_size: int, num_extends: int, num_decodes: int,
                    heads: tuple[int, int] = (4, 2), head_dim: int = 16, dtype=torch.float64,
                    cost: CostModel = ALWAYS, runs_of_pages: bool = False, split_pages: bool = False) -> Scenario:
    """``runs_of_pages``: each node's pages are one or two runs of consecutive ids (as the allocator
    hands out a prompt's pages) instead of random ids; ``split_pages``: decode groups are split at
    page-id breaks (every piece, however short) as on a TMA-capable GPU."""
    free = list(range(1, 400))
    rng.shuffle(free)
    nodes: list[Node] = []
    next_run = 400                     # consecutive runs come from ids past the shuffled ones
    for node_id in range(rng.randint(1, 7)):
        parent = rng.choice([None, *nodes]) if nodes else None
        num_pages = rng.randint(1, 3)
        if runs_of_pages:
            cut = rng.randint(1, num_pages)
            pages = list(range(next_run, next_run + cut)) + list(range(next_run + cut + 1, next_run + num_pages + 1))
            next_run += num_pages + 2
        else:
            pages = [free.pop() for _ in range(num_pages)]
        nodes.append(Node(node_id, parent, num_pages * page_size, pages))

    def request(num_new: int) -> tuple[BatchRequest, list[Node]]:
        path = rng.choice(nodes).path() if rng.random() < 0.9 else []
        start = sum(n.tokens for n in path)
        pages = [p for n in path for p in n.pages]
        while len(pages) * page_size < start + num_new:
            pages.append(free.pop())
        return BatchRequest(pages, start, num_new), path

    extends = [request(rng.randint(1, 6)) for _ in range(num_extends)]
    decodes = []
    for _ in range(num_decodes):
        req, path = request(1)
        own = rng.randint(0, 2 * page_size)          # tokens the row decoded after its cached path
        pages = list(req.pages)
        while len(pages) * page_size < req.start + own + 1:
            pages.append(free.pop())
        decodes.append((BatchRequest(pages, req.start + own, 1), path))

    rows = [DecodeRow(i, _segments(path), req.start + 1) for i, (req, path) in enumerate(decodes)]
    plan = plan_groups(rows, cost, page_size)
    work = [r for r, _ in extends] + [r for r, _ in decodes]
    ext_runs, kv_start = prefill_runs(work[:num_extends], cost, page_size)
    dec_runs, num_groups = None, len(ext_runs)
    kv_start += [0] * num_decodes
    if plan is not None:
        runs = decode_runs(plan, range(num_decodes), lambda i: decodes[i][0].pages, page_size, split_pages,
                           min_piece_pages=1)
        dec_runs, num_groups = build_shared_runs(runs, "cpu"), num_groups + len(runs)
        kv_start[num_extends:] = [plan.own_start.get(i, 0) for i in range(num_decodes)]
    cascaded = build_forward_batch(work, page_size, "cpu", num_decodes=num_decodes, kv_start=kv_start,
                                   decode_runs=dec_runs, prefill_runs=build_shared_runs(ext_runs, "cpu"))
    cache = KVCache(num_layers=1, num_pages=next_run, page_size=page_size, num_kv_heads=heads[1], head_dim=head_dim,
                    dtype=dtype, device="cpu")
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=gen, dtype=torch.float64) * 2)
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=gen, dtype=torch.float64))
    return Scenario(cache, dataclasses.replace(cascaded, cascade=None), cascaded, num_groups)


def _segments(path: list[Node]) -> list[PathSegment]:
    segments, start = [], 0
    for node in path:
        segments.append(PathSegment(node.node_id, start, node.tokens))
        start += node.tokens
    return segments


def batch_on(x, device):
    """A batch (its tensors, nested dataclasses included) on ``device``."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if dataclasses.is_dataclass(x):
        return dataclasses.replace(x, **{f.name: batch_on(getattr(x, f.name), device)
                                         for f in dataclasses.fields(x)})
    return x
