"""Role markers: the text a chat template puts around each message, for incremental rendering.

A program builds its text piece by piece (``s += rl.user(...)``, then a ``gen`` inside
``rl.assistant(...)``), so it needs, per role, the text before and after a message's content
rather than a whole rendered conversation. ``RoleMarkers.from_template`` renders the model's
template around a sentinel content and splits the result:

- a conversation's first message may carry a preamble (SmolLM2 adds a default system prompt when
  the first message is not a system message): ``first_begin`` is rendered with no message before;
- later messages are rendered after an anchor message and cut after the anchor's own text.

This is exact for templates that render each message as its own block (ChatML, Llama 3, ...);
templates that merge messages (e.g. a system prompt folded into the first user turn) are
approximated. Without a template, ``RoleMarkers.plain()`` writes ``User: ...`` lines.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from radixrelay.lang.expr import Role
from radixrelay.text.chat_template import ChatTemplate

ROLES: tuple[Role, ...] = ("system", "user", "assistant")
_SENTINEL = "<<RadixRelay:Content>>"   # mixed case: a template that changes case is caught
_ANCHORS: tuple[tuple[dict[str, str], ...], ...] = (
    ({"role": "system", "content": "A"},),
    ({"role": "user", "content": "A"},),
    ({"role": "user", "content": "A"}, {"role": "assistant", "content": "B"}),
)


@dataclass(frozen=True)
class RoleMarkers:
    first_begin: Mapping[Role, str]   # before the content of a conversation's first message
    begin: Mapping[Role, str]         # before the content of any later message
    end: Mapping[Role, str]           # after the content

    def open(self, role: Role, first: bool) -> str:
        return (self.first_begin if first else self.begin)[role]

    @classmethod
    def plain(cls) -> RoleMarkers:
        """The fallback: ``System: ...``, ``User: ...``, ``Assistant: ...``, one message a line."""
        begin = {r: f"{r.capitalize()}: " for r in ROLES}
        return cls(begin, begin, {r: "\n" for r in ROLES})

    @classmethod
    def from_template(cls, template: ChatTemplate, strip_bos: str | None = None) -> RoleMarkers:
        """Markers of a chat template; ``strip_bos``: a BOS text to drop from the first message's
        begin (when the tokenizer adds BOS itself, a template's BOS would be doubled)."""
        first_begin, begin, end = {}, {}, {}
        for role in ROLES:
            head, end[role] = _split(template.render([_message(role)], add_generation_prompt=False))
            if strip_bos:
                head = head.removeprefix(strip_bos)
            first_begin[role] = head
            begin[role] = _later_begin(template, role)
        return cls(first_begin, begin, end)


def _message(role: str) -> dict[str, str]:
    return {"role": role, "content": _SENTINEL}


def _split(rendered: str) -> tuple[str, str]:
    if rendered.count(_SENTINEL) != 1:
        raise ValueError("the chat template does not render message content verbatim; "
                         "pass chat_template=RoleMarkers(...) to the backend")
    head, tail = rendered.split(_SENTINEL)
    return head, tail


def _later_begin(template: ChatTemplate, role: Role) -> str:
    for anchor in _ANCHORS:
        if anchor[-1]["role"] == role:
            continue
        try:
            before = template.render(list(anchor), add_generation_prompt=False)
            rendered = template.render([*anchor, _message(role)], add_generation_prompt=False)
        except ValueError:          # templates may refuse some role orders
            continue
        if rendered.startswith(before):
            return _split(rendered[len(before):])[0]
    raise ValueError(f"cannot find the chat template's marker for a {role} message after another "
                     "message; pass chat_template=RoleMarkers(...) to the backend")
