import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixrelay.radix.allocator import PageAllocator


def test_alloc_is_exact_and_all_or_nothing():
    a = PageAllocator(4)
    assert a.alloc(2) == [0, 1]
    assert a.alloc(3) is None and a.num_free == 2       # all-or-nothing
    a.free([1, 0])
    assert a.free_runs() == [(0, 4)]                    # freed pages merge with their free neighbours
    assert a.alloc(4) == [0, 1, 2, 3]
    assert a.alloc(1) is None and a.alloc(0) == []
    a.check_integrity()


def test_one_run_takes_the_shortest_run_that_fits():
    a = PageAllocator(20)
    assert a.alloc(20) == list(range(20))
    a.free([0, 1, 2, 5, 6, 7, 8, 9, 12, 13, 14, 15, 16, 17, 18, 19])   # runs: 3 @0, 5 @5, 8 @12
    assert a.free_runs() == [(0, 3), (5, 5), (12, 8)]
    assert a.alloc(4) == [5, 6, 7, 8]                   # shortest run >= 4 is the 5 @5
    assert a.alloc(6) == [12, 13, 14, 15, 16, 17]       # only the 8 @12 fits
    assert a.free_runs() == [(0, 3), (9, 1), (18, 2)]
    assert a.alloc(3) == [0, 1, 2]                      # an exact fit leaves no stub
    a.check_integrity()


def test_one_run_falls_back_to_the_longest_runs():
    a = PageAllocator(12)
    a.alloc(12)
    a.free([0, 1, 4, 5, 6, 9, 10, 11])                  # runs: 2 @0, 3 @4, 3 @9
    assert a.alloc(5) == [9, 10, 11, 4, 5]              # no run of 5: longest first (fewest pieces)
    assert a.free_runs() == [(0, 2), (6, 1)]
    a.check_integrity()


def test_scattered_alloc_uses_short_runs_and_keeps_long_ones():
    a = PageAllocator(16)
    a.alloc(16)
    a.free([0, 3, 4, 8, 9, 10, 11, 12, 13, 14, 15])     # runs: 1 @0, 2 @3, 8 @8
    assert a.alloc(3, one_run=False) == [0, 3, 4]       # one page per decoding request
    assert a.free_runs() == [(8, 8)]                    # the long run stays whole for a prompt
    assert a.alloc(8) == list(range(8, 16))
    a.check_integrity()


def test_free_rejects_double_free_and_out_of_range():
    a = PageAllocator(2)
    a.alloc(1)
    with pytest.raises(ValueError, match="already free"):
        a.free([1])
    with pytest.raises(ValueError, match="out of range"):
        a.free([2])
    b = PageAllocator(3)
    b.alloc(3)
    with pytest.raises(ValueError, match="already free"):
        b.free([1, 1])                                  # a duplicate within one call
    assert b.num_free == 0                              # and nothing was freed
    b.check_integrity()
    with pytest.raises(ValueError):
        PageAllocator(0)
    with pytest.raises(ValueError, match="n must be >= 0"):
        a.alloc(-1)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 40), st.booleans(), st.randoms()), max_size=40))
def test_random_alloc_free_keeps_every_page_exactly_once(ops):
    """Against a naive model: pages handed out are free, distinct, ``n`` of them; a one-run request
    gets consecutive ids whenever a long enough free run exists; runs stay maximal."""
    num_pages = 64
    a = PageAllocator(num_pages)
    held: list[list[int]] = []
    for is_alloc, n, one_run, rnd in ops:
        if is_alloc or not held:
            free_before = set(a.free_pages())
            runs_before = a.free_runs()
            pages = a.alloc(n, one_run=one_run)
            if n > len(free_before):
                assert pages is None
                continue
            assert len(pages) == n and len(set(pages)) == n and set(pages) <= free_before
            if one_run and n and any(length >= n for _, length in runs_before):
                assert pages == list(range(pages[0], pages[0] + n))
            held.append(pages)
        else:
            victim = held.pop(rnd.randrange(len(held)))
            rnd.shuffle(victim)
            a.free(victim)
        a.check_integrity()
        in_use = [p for h in held for p in h]
        assert sorted(in_use + a.free_pages()) == list(range(num_pages))
