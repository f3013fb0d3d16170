"""``StructuredOutput``: one request's output constraint, as it travels with ``SamplingParams``.

Kinds: ``json_object`` (any JSON object), ``json_schema`` (``value`` is the schema as JSON text,
compiled strictly: no properties beyond the schema's), ``regex`` (``value`` is the pattern, matched
in full), ``choice`` (``choices``: the output is exactly one of them). Size limits bound the work a
single request can ask of the grammar compiler (hostile schemas are refused, never left to hang).
"""

from __future__ import annotations

import json
from typing import Any, Literal

import msgspec

MAX_SPEC_CHARS = 32_768          # schema JSON text or regex
MAX_SCHEMA_DEPTH = 24            # nesting of objects/arrays in a JSON schema
MAX_CHOICES = 1_024
MAX_CHOICE_CHARS = 4_096

Kind = Literal["json_object", "json_schema", "regex", "choice"]


class InvalidStructuredOutput(ValueError):
    """A constraint this server cannot compile; the message says why (the grammar engine's words
    where it refused)."""


class StructuredOutput(msgspec.Struct, frozen=True, kw_only=True):
    kind: Kind
    value: str = ""                       # json_schema: the schema's JSON text; regex: the pattern
    choices: tuple[str, ...] = ()         # choice: the allowed outputs

    def __post_init__(self) -> None:
        if self.kind in ("json_schema", "regex"):
            if not isinstance(self.value, str) or not self.value:
                raise InvalidStructuredOutput(f"{self.kind}: must be a non-empty string")
            if len(self.value) > MAX_SPEC_CHARS:
                raise InvalidStructuredOutput(f"{self.kind}: {len(self.value)} characters, at most "
                                              f"{MAX_SPEC_CHARS} are accepted")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.value)
            except (ValueError, RecursionError) as exc:
                raise InvalidStructuredOutput(f"json_schema: not valid JSON ({exc})") from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidStructuredOutput("json_schema: a schema is a JSON object")
            if _depth(schema) > MAX_SCHEMA_DEPTH:
                raise InvalidStructuredOutput(f"json_schema: nested deeper than {MAX_SCHEMA_DEPTH} levels")
        if self.kind == "choice":
            if not self.choices or len(self.choices) > MAX_CHOICES:
                raise InvalidStructuredOutput(f"choice: 1 to {MAX_CHOICES} choices, got {len(self.choices)}")
            if any(not isinstance(c, str) or not c or len(c) > MAX_CHOICE_CHARS for c in self.choices):
                raise InvalidStructuredOutput(f"choice: each choice is a non-empty string of at most "
                                              f"{MAX_CHOICE_CHARS} characters")
        elif self.choices:
            raise InvalidStructuredOutput(f"{self.kind}: choices apply to kind 'choice' only")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> StructuredOutput:
        return cls(kind="json_schema", value=schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def json_object(cls) -> StructuredOutput:
        return cls(kind="json_object")

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        return cls(kind="regex", value=pattern)

    @classmethod
    def choice(cls, choices: list[str] | tuple[str, ...]) -> StructuredOutput:
        return cls(kind="choice", choices=tuple(choices))


def _depth(node: Any) -> int:
    """Nesting depth of JSON containers (iterative: a hostile schema cannot exhaust the stack)."""
    deepest, stack = 0, [(node, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            if depth > MAX_SCHEMA_DEPTH:
                return depth
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest
