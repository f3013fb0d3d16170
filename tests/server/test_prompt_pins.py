"""Pins asked by HTTP requests (``radixrelay.server.prompt_pins``): cache_control marks found and their
token boundaries, with a stand-in template and tokenizer."""

from __future__ import annotations

import numpy as np
import pytest

from radixrelay.protocol.messages import PinSpec
from radixrelay.server import openai_protocol as oa
from radixrelay.server.prompt_pins import cache_marks, chat_pins, retention_pins


def render(messages, generation_prompt=False) -> str:
    """A template: each message as <role>text</>, parts joined."""
    out = ""
    for m in messages:
        content = m["content"] if isinstance(m["content"], str) else "".join(p["text"] for p in m["content"])
        out += f"<{m['role']}>{content}</>"
    return out + ("<assistant>" if generation_prompt else "")


def encode(text: str) -> np.ndarray:
    return np.array([ord(c) for c in text], dtype=np.int32)


def test_marks_on_messages_and_parts_end_where_the_mark_is():
    mark = {"type": "ephemeral"}
    messages = [{"role": "system", "content": "tools", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
                {"role": "user", "content": [{"type": "text", "text": "doc", "cache_control": mark},
                                             {"type": "text", "text": "question"}]}]
    prompt = encode(render(messages, generation_prompt=True))
    pins = chat_pins(cache_marks(messages), prompt, render, encode)
    assert pins == [PinSpec(len("<system>tools</>"), 3600.0),
                    PinSpec(len("<system>tools</><user>doc"), 300.0)]   # the part's end: the message goes on
    assert retention_pins("24h", 7) == [PinSpec(7, 86400.0)] and retention_pins("in_memory", 7) == []


@pytest.mark.parametrize("mark", [{"type": "persistent"}, {"type": "ephemeral", "ttl": "2h"}, "yes",
                                  {"type": "ephemeral", "ttl": "5m", "scope": "x"}])
def test_malformed_marks_are_400s(mark):
    with pytest.raises(oa.APIError, match="cache_control") as err:
        cache_marks([{"role": "user", "content": "hi", "cache_control": mark}])
    assert err.value.status == 400 and err.value.param == "messages"


def test_at_most_four_marks():
    mark = {"type": "ephemeral"}
    with pytest.raises(oa.APIError, match="at most 4"):
        cache_marks([{"role": "user", "content": "hi", "cache_control": mark}] * 5)
