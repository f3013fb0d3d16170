import pytest

from radixrelay.radix.allocator import PageAllocator


def test_alloc_is_fifo_and_exact():
    a = PageAllocator(4)
    assert a.alloc(2) == [0, 1]
    assert a.alloc(3) is None and a.num_free == 2       # all-or-nothing
    a.free([1, 0])
    assert a.alloc(4) == [2, 3, 1, 0]                   # oldest-freed first
    assert a.alloc(1) is None and a.alloc(0) == []
    a.check_integrity()


def test_free_rejects_double_free_and_out_of_range():
    a = PageAllocator(2)
    a.alloc(1)
    with pytest.raises(ValueError, match="already free"):
        a.free([1])
    with pytest.raises(ValueError, match="out of range"):
        a.free([2])
    with pytest.raises(ValueError):
        PageAllocator(0)
