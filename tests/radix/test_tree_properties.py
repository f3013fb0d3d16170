"""Property test: the radix tree against a naive model of cached whole-page prefixes.

The model keeps, per salt, a dict {prefix (a whole number of pages) -> page id of its last page}.
Matching is "longest prefix in the dict", inserting adds the missing prefixes, and eviction must
remove a prefix-closed set of unlocked prefixes, at least the requested pages (or all evictable).
"""

from __future__ import annotations

import itertools

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from radixrelay.radix.tree import RadixNode, RadixTree

SALTS = st.sampled_from([None, "s"])
Prefix = tuple[str | None, tuple[int, ...]]


class TreeVsModel(RuleBasedStateMachine):
    @initialize(page_size=st.sampled_from([1, 2, 3]))
    def setup(self, page_size: int) -> None:
        self.ps = page_size
        self.tree = RadixTree(page_size)
        self.model: dict[Prefix, int] = {}
        self.held: list[tuple[RadixNode, list[Prefix]]] = []
        self.fresh = itertools.count()
        self.hints: dict[tuple[str | None, tuple[int, ...]], tuple[RadixNode, int] | None] = {}

    def _seq(self, data: st.DataObject) -> list[int]:
        pages = data.draw(st.integers(0, 4))
        return data.draw(st.lists(st.integers(0, 2), min_size=pages * self.ps,
                                  max_size=pages * self.ps))

    def _prefixes(self, salt: str | None, seq: list[int]) -> list[Prefix]:
        return [(salt, tuple(seq[:k])) for k in range(self.ps, len(seq) + 1, self.ps)]

    def _model_match(self, salt: str | None, seq: list[int]) -> list[int]:
        pages = []
        for p in self._prefixes(salt, seq[: len(seq) - len(seq) % self.ps]):
            if p not in self.model:
                break
            pages.append(self.model[p])
        return pages

    @rule(data=st.data(), salt=SALTS)
    def insert(self, data: st.DataObject, salt: str | None) -> None:
        seq = self._seq(data)
        pages = [next(self.fresh) for _ in range(len(seq) // self.ps)]
        expected_existing = len(self._model_match(salt, seq)) * self.ps
        assert self.tree.insert(seq, pages, salt) == expected_existing
        for p, page in zip(self._prefixes(salt, seq), pages, strict=True):
            self.model.setdefault(p, page)

    @rule(data=st.data(), salt=SALTS, extra=st.integers(0, 2))
    def match(self, data: st.DataObject, salt: str | None, extra: int) -> None:
        seq = self._seq(data) + [0] * extra
        m = self.tree.match_prefix(seq, salt)
        expected = self._model_match(salt, seq)
        assert m.pages == expected and m.num_tokens == len(expected) * self.ps
        assert self.tree.peek_prefix(seq, salt)[1] == m.num_tokens

    @rule(data=st.data(), salt=SALTS, extra=st.integers(0, 2))
    def peek_resumed(self, data: st.DataObject, salt: str | None, extra: int) -> None:
        """A queued request re-peeked across inserts, splits and evictions, resuming from its last hint
        (kept per sequence, as ``Request.tree_hint``), matches what a walk from the root finds."""
        seq = tuple(self._seq(data) + [0] * extra)
        if self.hints and data.draw(st.booleans()):          # often the same request again
            salt, seq = data.draw(st.sampled_from(sorted(self.hints, key=repr)))
        hint, matched = self.tree.peek_resumed(list(seq), salt, self.hints.get((salt, seq)))
        assert matched == len(self._model_match(salt, list(seq))) * self.ps
        if hint is not None:
            node, end = hint
            assert sum(len(n.key) for n in self.tree.path(node)) == end <= matched
        self.hints[(salt, seq)] = hint

    @rule(data=st.data(), salt=SALTS)
    def lock(self, data: st.DataObject, salt: str | None) -> None:
        seq = self._seq(data)
        m = self.tree.match_prefix(seq, salt)
        if m.node is not None:
            self.tree.lock(m.node)
            self.held.append((m.node, self._prefixes(salt, seq[: m.num_tokens])))

    @rule(index=st.integers(0, 10))
    def unlock(self, index: int) -> None:
        if self.held:
            node, _ = self.held.pop(index % len(self.held))
            self.tree.unlock(node)

    @rule(num_pages=st.integers(0, 6))
    def evict(self, num_pages: int) -> None:
        locked = {p for _, path in self.held for p in path}
        evictable = len(self.model) - len(locked)
        freed = self.tree.evict(num_pages)
        assert len(freed) >= min(num_pages, evictable)
        gone = set(freed)
        removed = {p for p, page in self.model.items() if page in gone}
        assert len(removed) == len(freed) and not removed & locked
        self.model = {p: page for p, page in self.model.items() if p not in removed}
        for salt, key in self.model:   # still prefix closed
            assert all((salt, key[:k]) in self.model for k in range(self.ps, len(key), self.ps))

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "tree"):
            return
        self.tree.check_integrity()
        for (salt, seq), hint in self.hints.items():     # a stale hint is never trusted
            assert self.tree.peek_resumed(list(seq), salt, hint)[1] == len(self._model_match(salt, list(seq))) * self.ps
        locked = {p for _, path in self.held for p in path}
        assert self.tree.cached_tokens == len(self.model) * self.ps
        assert self.tree.locked_tokens == len(locked) * self.ps
        pages = [p for n in self.tree.nodes() for p in n.pages]
        assert sorted(pages) == sorted(self.model.values())


TreeVsModel.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_tree_vs_model = TreeVsModel.TestCase
