"""Packed prompt token ids (runtime/token_ids.py): what the scheduler unpacks equals what was sent, as an
int32 array (no Python object per token)."""

import numpy as np
import pytest

from radixrelay.protocol.messages import FrontendMessage, GenerateRequest, decoder, encoder
from radixrelay.protocol.token_ids import pack_token_ids, unpack_token_ids
from radixrelay.sampling_params import SamplingParams


def test_packed_ids_round_trip_through_the_channel_as_an_int32_array():
    ids = np.array([5, 0, 127, 5, 99], dtype=np.int64)
    wire = pack_token_ids(ids)
    assert wire == ids.astype("<i4").tobytes()
    message = decoder(FrontendMessage).decode(encoder().encode(GenerateRequest(1, wire, SamplingParams())))
    got = unpack_token_ids(message.token_ids)
    assert got.dtype == np.int32 and got.tolist() == [5, 0, 127, 5, 99]
    assert unpack_token_ids(pack_token_ids(np.array([], dtype=np.int64))).tolist() == []


def test_lists_keep_their_values_and_ids_outside_int32_are_refused():
    assert pack_token_ids([1, 2]) == [1, 2]                     # a list is sent as it is
    assert unpack_token_ids([1, 2]).tolist() == [1, 2]
    assert unpack_token_ids(pack_token_ids(np.array([3, 8, -1]))).tolist() == [3, 8, -1]
    big = np.array([1, 2**40])
    assert pack_token_ids(big) == [1, 2**40]                    # does not fit int32: sent as a list
    with pytest.raises(ValueError):
        unpack_token_ids([1, 2**40])                            # ... and refused by the scheduler
    with pytest.raises(ValueError):
        unpack_token_ids(b"\x01\x00\x00")                        # not whole int32s: rejected as invalid
