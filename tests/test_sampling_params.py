"""SamplingParams refuses what no sampler can use, with the field's name (the Python API's check; the
HTTP layer checks the same before building one)."""

from __future__ import annotations

import math

import msgspec
import pytest

from radixrelay.sampling_params import MAX_STOP_TOKEN_IDS, SamplingParams


@pytest.mark.parametrize("field, value", [
    ("temperature", math.nan), ("temperature", math.inf), ("temperature", -1.0), ("temperature", "1"),
    ("repetition_penalty", math.nan), ("repetition_penalty", math.inf), ("top_p", math.nan),
    ("min_p", math.nan), ("frequency_penalty", math.inf), ("presence_penalty", math.nan),
    ("top_k", 2.5), ("top_k", True), ("seed", 2 ** 64), ("top_k", 2 ** 70), ("max_tokens", 2 ** 64), ("max_tokens", True),
    ("stop_token_ids", (2 ** 64,)), ("stop_token_ids", (-1,)), ("seed", -(2 ** 63) - 1), ("seed", 1.5), ("seed", True),
    ("logit_bias", ((1, 101.0),)), ("logit_bias", ((-1, 1.0),)), ("logit_bias", ((1, math.nan),)),
    ("logit_bias", ((True, 1.0),)), ("logit_bias", tuple((i, 1.0) for i in range(301))),
    ("min_tokens", -1), ("min_tokens", 17), ("min_tokens", 1.5),
])
def test_unusable_values_name_their_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


def test_stop_token_ids_are_bounded_in_count_duplicates_included():
    SamplingParams(stop_token_ids=tuple(range(MAX_STOP_TOKEN_IDS)))
    SamplingParams(stop_token_ids=(7,) * MAX_STOP_TOKEN_IDS)
    with pytest.raises(ValueError, match=f"SamplingParams.stop_token_ids: at most {MAX_STOP_TOKEN_IDS} .* got 192000"):
        SamplingParams(stop_token_ids=tuple(range(192_000)))
    with pytest.raises(ValueError, match="SamplingParams.stop_token_ids"):
        SamplingParams(stop_token_ids=(7,) * (MAX_STOP_TOKEN_IDS + 1))


def test_edges_that_are_valid():
    SamplingParams(temperature=0, seed=2 ** 63 - 1, top_k=0, repetition_penalty=2)
    SamplingParams(seed=-(2 ** 63), temperature=1)


def test_decoding_a_message_validates_too():
    with pytest.raises(msgspec.ValidationError, match="seed"):
        msgspec.json.decode(b'{"seed": 18446744073709551616}', type=SamplingParams)


def test_min_tokens_and_logit_bias_cross_processes():
    sp = SamplingParams(max_tokens=8, min_tokens=8, logit_bias=((3, -100.0), (7, 2.5)))
    again = msgspec.msgpack.decode(msgspec.msgpack.encode(sp), type=SamplingParams)
    assert again == sp and again.logit_bias == ((3, -100.0), (7, 2.5))
    from radixrelay.structured import StructuredOutput
    with pytest.raises(ValueError, match="SamplingParams.min_tokens"):
        SamplingParams(min_tokens=1, structured=StructuredOutput(kind="regex", value="a+"))
