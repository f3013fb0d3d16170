"""Where a request's last walk of the radix tree ended (``Request.tree_hint``), so the next walk of its
tokens resumes there instead of at the root (valid because a request's tokens only grow; a hint whose
node has left the tree is ignored by ``RadixTree.peek_resumed``). This module is the hint's only writer:
the queue policy, the cache manager, the tier coordinator and the content keys all walk through
``peek``."""

from __future__ import annotations

from radixrelay.radix.tree import RadixNode, RadixTree
from radixrelay.scheduler.request import Request


def peek(tree: RadixTree, req: Request, length: int) -> tuple[tuple[RadixNode, int] | None, int]:
    """The deepest cached node on ``req``'s first ``length`` tokens and the tokens matched (a read of the
    tree: nothing locked or touched), the walk resumed at ``req.tree_hint`` and its end kept there."""
    req.tree_hint, matched = tree.peek_resumed(req.token_ids, req.salt, req.tree_hint, length=length)
    return req.tree_hint, matched
