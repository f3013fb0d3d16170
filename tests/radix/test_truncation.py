"""The truncation rule (``radixrelay.radix.truncation``): whole page-aligned chunks, a stable point."""

from __future__ import annotations

import pytest

from radixrelay.radix.truncation import Truncated, Truncation

T = Truncation(ratio=0.5, context=256, page_size=16)


def test_fitting_prompt_is_unchanged():
    ids = list(range(200))
    assert T.apply(ids, 56) == Truncated(ids)


def test_overflow_keeps_the_head_page_and_drops_whole_chunks_after_it():
    ids = list(range(300))
    out = T.apply(ids, 8)                     # 300 + 8 > 256: one chunk of 128 dropped after the head
    assert out.ids == ids[:16] + ids[144:] and out.dropped == 128
    assert (out.shifted_prefix, out.shifted_at) == (ids[16:144], 16)    # previous point: nothing dropped
    out = T.apply(list(range(500)), 8)        # needs 252 dropped: two chunks
    assert out.dropped == 256 and out.ids == list(range(16)) + list(range(272, 500))
    assert out.shifted_prefix == list(range(144, 272))
    assert Truncation(0.5, 256, 2).head == 4  # the sink: at least 4 tokens, whole pages


def test_truncation_point_is_stable_while_a_conversation_grows():
    points = {T.apply(list(range(n)), 8).dropped for n in range(249, 377)}
    assert points == {128}


def test_chunk_rounds_up_to_pages_and_bad_inputs_raise():
    assert Truncation(0.3, 100, 16).chunk == 32            # ceil(30) -> 32
    with pytest.raises(ValueError, match="cannot make it fit"):
        T.apply(list(range(300)), 250)                     # 6 tokens left: no chunk count fits
    with pytest.raises(ValueError, match="ratio"):
        Truncation(1.0, 256, 16)
