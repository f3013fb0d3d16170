"""KV page allocator and radix tree of token prefixes (indices only; no GPU code)."""

from radixrelay.radix.allocator import PageAllocator
from radixrelay.radix.tree import MatchResult, RadixNode, RadixTree

__all__ = ["MatchResult", "PageAllocator", "RadixNode", "RadixTree"]
