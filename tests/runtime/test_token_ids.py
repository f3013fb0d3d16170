"""Packed prompt token ids (runtime/token_ids.py): what the scheduler unpacks equals what was sent."""

import numpy as np
import pytest

from radixrelay.protocol.messages import FrontendMessage, GenerateRequest, decoder, encoder
from radixrelay.runtime.token_ids import TokenTable, pack_token_ids
from radixrelay.sampling_params import SamplingParams


def test_packed_ids_round_trip_through_the_channel_as_shared_ints():
    ids = np.array([5, 0, 127, 5, 99], dtype=np.int64)
    wire = pack_token_ids(ids)
    assert wire == ids.astype("<i4").tobytes()
    message = decoder(FrontendMessage).decode(encoder().encode(GenerateRequest(1, wire, SamplingParams())))
    table = TokenTable(128)
    first, second = table.unpack(message.token_ids), table.unpack(message.token_ids)
    assert first == [5, 0, 127, 5, 99] and all(type(t) is int for t in first)
    assert all(a is b for a, b in zip(first, second))          # one int object per id: identity compares
    assert table.unpack(pack_token_ids(np.array([], dtype=np.int64))) == []


def test_lists_and_ids_outside_the_table_or_int32_keep_their_values():
    table = TokenTable(8)
    assert pack_token_ids([1, 2]) == [1, 2]                     # a list is sent as it is
    assert table.unpack([1, 2]) == [1, 2]
    assert table.unpack(pack_token_ids(np.array([3, 8, -1]))) == [3, 8, -1]   # outside [0, 8): plain ints
    big = np.array([1, 2**40])
    assert pack_token_ids(big) == [1, 2**40]                    # does not fit int32: sent as a list
    with pytest.raises(ValueError):
        table.unpack(b"\x01\x00\x00")                            # not whole int32s: rejected as invalid
