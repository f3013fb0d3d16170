"""A request's tokens as int32 (``radix/tokens.py``): the prompt kept as it arrived, outputs appended,
values that never change once given out, list-like reads."""

import numpy as np
import pytest

from radixrelay.radix.tokens import TokenArray, as_tokens, first_difference


def test_a_read_only_prompt_is_kept_without_a_copy_and_outputs_join_it_once():
    wire = np.frombuffer(np.arange(10, dtype="<i4").tobytes(), dtype=np.int32)    # as unpacked from a message
    t = TokenArray(wire)
    assert t.array is wire and np.shares_memory(t.prefix(4), wire)
    for token in range(100, 140):
        t.append(token)
    assert np.shares_memory(t.prefix(10), wire) and len(t) == 50     # the prompt alone: not joined
    assert t[9] == 9 and t[10] == 100 and t[-1] == 139 and t[8:12] == [8, 9, 100, 101]
    view = t.array                                                   # joined once
    assert view.tolist() == list(range(10)) + list(range(100, 140)) and not view.flags.writeable
    t.append(7)
    assert view.tolist() == list(range(10)) + list(range(100, 140))  # a view given out never changes
    assert t.array[-1] == 7 and t[-2:] == [139, 7] and t.tolist()[-1] == 7


def test_a_writable_array_is_copied_and_ids_outside_int32_are_refused():
    mine = np.array([1, 2, 3], dtype=np.int32)
    t = TokenArray(mine)
    mine[0] = 99
    assert t[0] == 1
    assert TokenArray([4, 5]) == [4, 5] and TokenArray([4, 5]) != [4, 6]
    with pytest.raises(ValueError):
        as_tokens([1, 2**31])
    with pytest.raises(ValueError):
        as_tokens(np.array([-(2**31) - 1]))
    with pytest.raises(IndexError):
        TokenArray([1])[1]


def test_first_difference():
    a = np.array([1, 2, 3, 4], dtype=np.int32)
    assert first_difference(a, a) == 4
    assert first_difference(a, a[:2]) == 2
    assert first_difference(a, np.array([1, 2, 9, 4], dtype=np.int32)) == 2
    assert first_difference(a[:0], a) == 0
