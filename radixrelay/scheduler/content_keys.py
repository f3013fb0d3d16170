"""Content keys of requests' pages (``radixrelay.radix.page_keys``: blake2b, 16 bytes, chained from the
namespace and salt; the lower KV tiers' addresses and the KV events' names), for the tier coordinator and
the KV events alike: one owner, so a page is hashed once whichever asks first.

Where a key comes from:
- a page the radix tree holds: its node's (``RadixNode.page_keys``), computed once in the node's life, the
  first time anyone asks for a key of that node or below it, and kept through splits;
- any other page of a request: hashed here when a tier or an event first asks for it, and kept on the
  request (``Request.prefix_keys``: the keys of its leading pages, a prefix of the chain; tokens only grow).

A request's ``prefix_keys`` thus begins with its tree path's keys, copied off the nodes (a list copy, C
speed), and its own pages are hashed at most once: a node made of a request's pages takes the keys the
request already has (``of_path``'s ``known``). Callers ask only as far as they need (the tier
coordinator walks host memory page by page and asks for keys in growing runs), so a cached prompt
costs O(new pages) hashes, never O(prompt). ``hashed_pages`` counts every page hashed here.
"""

from __future__ import annotations

import numpy as np

from radixrelay.radix.page_keys import chain_seed, extend_keys
from radixrelay.radix.tree import RadixNode, RadixTree
from radixrelay.scheduler.request import Request
from radixrelay.scheduler.match_hint import peek

MAX_SEEDS = 4096          # (salt) chain seeds kept (salts come from clients: bounded)


class ContentKeys:
    def __init__(self, tree: RadixTree, namespace: str, use_tree: bool = True) -> None:
        self.tree = tree
        self.page_size = tree.page_size
        self.namespace = namespace
        self.use_tree = use_tree                 # False with the radix cache off (the tree stays empty)
        self._seeds: dict[str | None, bytes] = {}
        self.hashed_pages = 0                    # pages hashed (nodes' and requests'), since start

    def seed(self, salt: str | None) -> bytes:
        seed = self._seeds.get(salt)
        if seed is None:
            if len(self._seeds) >= MAX_SEEDS:
                self._seeds.clear()
            seed = self._seeds[salt] = chain_seed(self.namespace, salt)
        return seed

    def of_path(self, path: list[RadixNode], salt: str | None, known: list[bytes] = ()) -> list[bytes]:
        """The keys of a tree path's pages (root's child first), filling in nodes that have none yet: from
        ``known`` (keys of the leading pages of the same tokens, a request's) as far as it goes, hashed
        past it."""
        keys: list[bytes] = []
        prev = self.seed(salt)
        for node in path:
            keys.extend(self._node_keys(node, prev, known[len(keys):len(keys) + len(node.pages)]))
            prev = keys[-1] if keys else prev
        return keys

    def _node_keys(self, node: RadixNode, prev: bytes, known: list[bytes] = ()) -> list[bytes]:
        """``node.page_keys``, made once in the node's life: ``known`` (its first keys, a request's) as far
        as it goes, hashed past it, the chain continued from ``prev`` (the key of the page before it)."""
        if node.page_keys is None:
            n = len(node.pages)
            node.page_keys = extend_keys(list(known), prev, node.key, self.page_size, n)
            self.hashed_pages += n - min(n, len(known))
        return node.page_keys

    def of_tree(self) -> list[bytes]:
        """The keys of every page the tree holds (a KV-event snapshot), nodes' keys filled in where missing
        (once in a node's life), parents before children."""
        out: list[bytes] = []
        stack = [(child, self.seed(root.salt)) for root in self.tree.roots() for child in root.children.values()]
        while stack:
            node, prev = stack.pop()
            keys = self._node_keys(node, prev)
            out.extend(keys)
            last = keys[-1] if keys else prev
            stack.extend((child, last) for child in node.children.values())
        return out

    def of_node(self, node: RadixNode, salt: str | None, known: list[bytes] = ()) -> list[bytes]:
        return self.of_path(self.tree.path(node), salt, known)

    def of(self, req: Request, num_pages: int) -> list[bytes]:
        """The keys of ``req``'s first ``num_pages`` whole pages (``ensure``)."""
        keys = self.ensure(req, num_pages)
        return keys if len(keys) == num_pages else keys[:num_pages]

    def ensure(self, req: Request, num_pages: int) -> list[bytes]:
        """``req.prefix_keys``, made at least ``num_pages`` long. The part its tree path holds (found by a
        walk resumed from ``req.tree_hint``) is read off the nodes; only the rest is hashed."""
        keys = req.prefix_keys
        if len(keys) < num_pages and self.use_tree:
            hint, _ = peek(self.tree, req, num_pages * self.page_size)
            if hint is not None and hint[1] // self.page_size > len(keys):
                keys = req.prefix_keys = self.of_node(hint[0], req.salt, keys)
        if len(keys) < num_pages:
            before = len(keys)
            extend_keys(keys, self.seed(req.salt), req.token_ids, self.page_size, num_pages)
            self.hashed_pages += num_pages - before
        return keys

    def shifted(self, req: Request, num_pages: int) -> list[bytes]:
        """The keys of the first ``num_pages`` whole pages of a truncated prompt's previous sequence
        (``Request.shifted_prefix``, ``radixrelay.radix.truncation``), kept on the request."""
        if len(req.shifted_keys) < num_pages:
            at, tokens = req.shifted_at, req.token_ids.array
            previous = np.concatenate([tokens[:at], np.asarray(req.shifted_prefix, dtype=tokens.dtype), tokens[at:]])
            before = len(req.shifted_keys)
            req.shifted_keys = extend_keys(req.shifted_keys, self.seed(req.salt), previous, self.page_size, num_pages)
            self.hashed_pages += num_pages - before
        return req.shifted_keys[:num_pages]
