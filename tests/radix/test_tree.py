import pytest

from radixrelay.radix.tree import RadixTree


def test_match_insert_split_page_size_1():
    t = RadixTree(1)
    assert t.insert([1, 2, 3, 4], [10, 11, 12, 13]) == 0
    m = t.match_prefix([1, 2, 9])
    assert (m.pages, m.num_tokens) == ([10, 11], 2)
    # the match ended inside the node: it was split there, so the node ends exactly at the match
    assert m.node is not None and [n.key.tolist() for n in t.path(m.node)] == [[1, 2]]
    assert t.insert([1, 2, 5], [10, 11, 20]) == 2        # caller still owns pages[:2] (the tree's)
    assert t.match_prefix([1, 2, 5, 6]).pages == [10, 11, 20]
    assert t.match_prefix([1, 2, 3, 4, 5]).pages == [10, 11, 12, 13]
    assert t.match_prefix([7]).node is None
    assert t.cached_tokens == 5 and t.evictable_tokens == 5 and t.locked_tokens == 0
    t.check_integrity()


def test_page_size_4_matches_whole_pages_only():
    t = RadixTree(4)
    t.insert(list(range(8)), [3, 7])
    m = t.match_prefix(list(range(7)))                  # 7 tokens: only the first page is whole
    assert (m.pages, m.num_tokens) == ([3], 4)
    assert t.match_prefix([0, 1, 2, 3, 4, 5, 6, 99]).pages == [3]   # mismatch inside page 2
    assert t.match_prefix([0, 1, 2, 9, 4, 5, 6, 7]).pages == []     # mismatch inside page 1
    # a diverging insert splits at the page boundary
    assert t.insert([0, 1, 2, 3, 9, 9, 9, 9], [3, 8]) == 4
    keys = sorted(tuple(n.key) for n in t.nodes())
    assert keys == [(0, 1, 2, 3), (4, 5, 6, 7), (9, 9, 9, 9)]
    with pytest.raises(ValueError, match="whole pages"):
        t.insert([1, 2, 3], [0])
    t.check_integrity()


def test_lock_protects_path_and_lru_eviction_order():
    t = RadixTree(2)
    t.insert([1, 1, 2, 2], [0, 1])          # a: [1 1][2 2]
    t.insert([1, 1, 3, 3], [0, 2])          # b shares the first page; [0] is the tree's own
    t.insert([5, 5], [3])                   # c
    t.insert([6, 6], [4])                   # d
    t.match_prefix([5, 5])                  # c is now the most recent
    locked = t.match_prefix([1, 1, 3, 3]).node
    assert locked is not None
    t.lock(locked)                          # pins [1 1] and [3 3]
    assert t.locked_tokens == 4 and t.evictable_tokens == 6
    assert t.evict(1) == [1]                # LRU unlocked leaf: [2 2] (a's tail)
    assert t.evict(2) == [4, 3]             # then d, then c; locked path untouched
    assert t.evict(10) == []
    assert t.match_prefix([1, 1, 3, 3]).pages == [0, 2]
    t.unlock(locked)
    assert t.evict(1) == [2]                # leaf first, then its parent becomes a leaf
    assert t.evict(1) == [0]
    assert t.cached_tokens == 0
    with pytest.raises(ValueError, match="not locked"):
        t.unlock(locked)
    t.check_integrity()


def test_split_inherits_lock():
    t = RadixTree(1)
    t.insert([1, 2, 3], [0, 1, 2])
    node = t.match_prefix([1, 2, 3]).node
    assert node is not None
    t.lock(node)
    t.match_prefix([1, 4])                  # splits the locked node after one token
    assert [n.lock_ref for n in t.path(node)] == [1, 1]
    assert t.evict(3) == []
    t.unlock(node)
    t.check_integrity()
    assert t.evict(3) == [1, 2, 0]


def test_salts_never_share():
    t = RadixTree(1)
    t.insert([1, 2, 3], [0, 1, 2], salt="a")
    assert t.match_prefix([1, 2, 3, 4]).node is None
    assert t.match_prefix([1, 2, 3, 4], salt="b").node is None
    assert t.match_prefix([1, 2, 3, 4], salt="a").pages == [0, 1, 2]
    t.insert([1, 2], [5, 6], salt="b")
    assert t.match_prefix([1, 2], salt="b").pages == [5, 6]
    assert sorted(t.evict(5)) == [0, 1, 2, 5, 6]
    assert [r.salt for r in t.roots()] == []             # empty salted namespaces are dropped
    t.check_integrity()


def test_peek_does_not_split_or_touch():
    t = RadixTree(1)
    t.insert([1, 2, 3], [0, 1, 2])
    t.insert([4], [3])
    node, n = t.peek_prefix([1, 2, 9])
    assert node is not None and node.is_root and n == 2
    assert len(list(t.nodes())) == 2
    assert t.evict(1) == [2]                              # [1 2 3] is still the LRU leaf


def test_evict_takes_only_the_tail_of_a_long_leaf():
    t = RadixTree(2)
    t.insert(list(range(8)), [0, 1, 2, 3])
    assert t.evict(1) == [3]
    assert t.match_prefix(list(range(8))).pages == [0, 1, 2]
    assert t.evict(2) == [1, 2] and t.cached_tokens == 2
    t.check_integrity()


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_long_node_matches_up_to_the_first_differing_page(ps):
    """A node of thousands of pages, matched by token lists that differ from it at every kind of
    place (inside the first run of 256 pages, between runs, in the last page, nowhere)."""
    pages = 5000 // ps
    key = list(range(1000, 1000 + pages * ps))
    for diverge in [ps, ps + 1, 2 * ps - 1, 17 * ps, 256 * ps, 256 * ps + 3, 4000, len(key) - 1, len(key)]:
        diverge = min(diverge, len(key))
        t = RadixTree(ps)
        t.insert(key, list(range(pages)))
        query = [int(str(x)) for x in key]     # equal values, distinct int objects
        if diverge < len(key):
            query[diverge] = -1
        query += [7] * ps
        whole = diverge // ps * ps
        assert t.peek_prefix(query)[1] == whole
        m = t.match_prefix(query)
        assert (m.num_tokens, m.pages) == (whole, list(range(whole // ps)))
        t.check_integrity()


def test_length_limits_the_tokens_considered():
    t = RadixTree(2)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    assert t.insert(tokens, [0, 1, 2], length=6) == 0
    assert [n.key.tolist() for n in t.nodes()] == [[1, 2, 3, 4, 5, 6]]
    assert t.peek_prefix(tokens, length=5)[1] == 4
    assert t.peek_prefix(tokens, length=100)[1] == 6
    m = t.match_prefix(tokens, length=3)
    assert (m.pages, m.num_tokens) == ([0], 2)
    assert t.match_prefix(tokens, length=1).node is None
    assert t.insert(tokens, [0, 1, 2, 3], length=8) == 6
    assert t.match_prefix(tokens).pages == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="whole pages"):
        t.insert(tokens, [0, 1, 2, 3, 4], length=10)
    t.check_integrity()


@pytest.mark.parametrize("length", [None, 10])
def test_match_below_a_peeked_node_equals_a_full_match(length):
    """The admission's match starting at the node a peek found gives the full match: same node, pages
    from the root, token count (and splits the same node the same way)."""
    def build():
        t = RadixTree(page_size=2)
        t.insert([1, 2, 3, 4], [10, 11])
        t.insert([1, 2, 3, 4, 5, 6, 7, 8], [10, 11, 12, 13])
        t.insert([1, 2, 9, 9], [10, 14])
        return t
    for query in ([1, 2, 3, 4, 5, 6, 7, 0, 0], [1, 2, 3, 4, 5, 6, 7, 8, 1, 1], [1, 2, 9, 9, 9], [5, 5], [1, 2, 3, 4]):
        full, below = build(), build()
        want = full.match_prefix(query, length=length)
        node, _ = below.peek_prefix(query, length=length)
        got = below.match_prefix_below(query, node, length=length)
        assert (got.pages, got.num_tokens) == (want.pages, want.num_tokens), query
        assert (got.node is None) == (want.node is None)
        if want.node is not None:
            assert (got.node.key.tolist(), got.node.pages) == (want.node.key.tolist(), want.node.pages)
        full.check_integrity()
        below.check_integrity()


def test_peek_resumed_walks_only_below_its_hint_and_never_trusts_a_detached_one(monkeypatch):
    t = RadixTree(2)
    doc = list(range(100, 140))                         # a 40-token cached prefix
    t.insert(doc, list(range(20)))
    query = doc + [7, 8, 9, 10]
    hint, matched = t.peek_resumed(query, None, None)
    assert matched == 40 and hint is not None and hint[1] == 40
    compared = []
    real = t._common_pages
    monkeypatch.setattr(t, "_common_pages", lambda *a: compared.append(a) or real(*a))
    assert t.peek_resumed(query, None, hint) == (hint, 40) and not compared     # nothing above it again
    t.insert(doc + [7, 8], list(range(20)) + [50])      # grows below the hint: found from there
    compared.clear()
    hint2, matched = t.peek_resumed(query, None, hint)
    assert matched == 42 and hint2[1] == 42 and len(compared) == 1
    t.match_prefix(doc[:20])                            # a split above the hint keeps its end
    assert t.peek_resumed(query, None, hint2)[1] == 42
    assert sorted(t.evict(2)) == [19, 50]               # LRU: the query's leaf, then the document's last page
    assert t.peek_resumed(query, None, hint2)[1] == 38   # detached hint: walked from the root
    assert t.peek_resumed(query, "other", hint2) == (None, 0)   # another namespace: not its hint


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_a_match_is_the_longest_common_whole_pages_of_equal_tokens(page_size):
    """Nodes are int32 arrays compared in one pass: against a reference that compares token by token,
    prompts that differ from a cached one in a single token anywhere (first page, a page boundary, deep
    inside a long node, its last page) match exactly the whole pages before it, and any form of the same
    ids (list, int32 or int64 array, TokenArray) matches the same."""
    import numpy as np

    from radixrelay.radix.tokens import TokenArray

    rng = np.random.default_rng(page_size)
    ps = page_size
    cached = rng.integers(0, 1 << 31, 300 * ps).tolist()
    for trial in range(60):
        t = RadixTree(ps)
        t.insert(cached, list(range(300)))
        t.insert(cached[:120 * ps] + [7] * (4 * ps), list(range(120)) + [900, 901, 902, 903])   # a split
        at = int(rng.integers(0, len(cached)))
        query = list(cached)
        query[at] = (query[at] + 1 + int(rng.integers(0, 5))) % (1 << 31)
        want = at // ps * ps
        for form in (query, np.array(query, dtype=np.int32), np.array(query), TokenArray(query)):
            node, matched = t.peek_prefix(form)
            assert matched == want, (trial, at)
        m = t.match_prefix(query)
        assert (m.num_tokens, m.pages) == (want, list(range(want // ps)))
        assert sum(len(n.key) for n in t.path(m.node)) == want if want else m.node is None
        t.check_integrity()


def test_salts_never_share_nodes_even_for_equal_tokens():
    t = RadixTree(2)
    tokens = [1, 2, 3, 4, 5, 6]
    t.insert(tokens, [0, 1, 2], salt=None)
    assert t.match_prefix(tokens, salt="a").node is None
    assert t.insert(tokens, [3, 4, 5], salt="a") == 0           # nothing cached under "a": all of it new
    assert t.match_prefix(tokens, salt=None).pages == [0, 1, 2]
    assert t.match_prefix(tokens, salt="a").pages == [3, 4, 5]
    assert t.match_prefix(tokens, salt="").node is None          # "" is its own namespace, not None's
    t.check_integrity()


def test_partial_page_finds_the_child_with_the_longest_leading_run():
    t = RadixTree(4)
    t.insert([1, 2, 3, 4, 5, 6, 7, 8], [10, 11])
    t.insert([1, 2, 3, 4, 5, 6, 9, 9], [10, 12])
    t.insert([1, 2, 3, 4, 5, 0, 0, 0, 1, 1, 1, 1], [10, 13, 14])
    node = t.match_prefix([1, 2, 3, 4, 5, 6, 7, 0]).node       # whole pages: [1, 2, 3, 4]
    assert node is not None and t.match_prefix([1, 2, 3, 4, 5, 6, 7, 0]).num_tokens == 4
    found = t.partial_page([1, 2, 3, 4, 5, 6, 7, 0], node, 4, 4)
    assert found is not None and found[0].pages[0] == 11 and found[1] == 3      # 5, 6, 7 of page 11
    found = t.partial_page([1, 2, 3, 4, 5, 6, 7, 0], node, 4, 2)                 # at most 2 may be reused
    assert found is not None and found[1] == 2 and found[0].pages[0] in (11, 12)
    assert t.partial_page([1, 2, 3, 4, 8], node, 4, 1) is None                    # no child starts with 8
    assert t.partial_page([1, 2, 3, 4, 5], node, 4, 0) is None
    found = t.partial_page([1, 2, 7], None, 0, 3)                                 # nothing matched: the root
    assert found is not None and found[1] == 2 and found[0].pages[0] == 10
    assert t.partial_page([1, 2, 3], None, 0, 3, salt="other") is None           # another namespace
    t.check_integrity()


def test_partial_page_sees_children_added_split_and_evicted():
    t = RadixTree(2)
    t.insert([1, 2, 3, 4], [10, 11])
    node = t.match_prefix([1, 2, 9, 9]).node                      # splits: [1, 2] -> [3, 4]
    assert t.partial_page([1, 2, 3, 7], node, 2, 2)[1] == 1
    t.insert([1, 2, 5, 6], [10, 12])                              # a new child
    assert t.partial_page([1, 2, 5, 7], node, 2, 2)[0].pages == [12]
    t.check_integrity()
    t.match_prefix([1, 2, 5, 6])
    t.evict(1)                                                    # the least recent leaf: [3, 4]
    assert t.partial_page([1, 2, 3, 7], node, 2, 2) is None
    t.check_integrity()
