"""``StructuredOutput``: one request's output constraint, as it travels with ``SamplingParams``.

Kinds: ``json_object`` (any JSON object), ``json_schema`` (``value`` is the schema as JSON text,
compiled strictly: no properties beyond the schema's), ``regex`` (``value`` is the pattern, matched
in full), ``choice`` (``choices``: the output is exactly one of them), ``structural_tag`` (``value``
is an xgrammar structural tag as JSON text: tool calls, ``radixrelay.text.tool_calls``; each JSON
schema in it is held to the limits of ``json_schema``, the tag as a whole to ``MAX_TAG_CHARS``). Size limits bound the work a
single request can ask of the grammar compiler (hostile schemas are refused, never left to hang).
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import msgspec

MAX_SPEC_CHARS = 32_768          # schema JSON text or regex
MAX_TAG_CHARS = 8 * MAX_SPEC_CHARS   # a structural tag (the schemas of all of a request's tools)
MAX_SCHEMA_DEPTH = 24            # nesting of objects/arrays in a JSON schema
MAX_CHOICES = 1_024
MAX_CHOICE_CHARS = 4_096
# Counted repetitions: minLength/maxLength/minItems/maxItems/minProperties/maxProperties and regex
# counts {m,n} (``pattern``, ``guided_regex``). Each bounded repetition becomes a counted rule in the
# grammar; the bound caps its compile time and the tokens over which its matcher pays per-token
# Earley checks (a few hundred microseconds of host time a token, which batch mates wait for).
MAX_REPETITION = 256
_REPETITION_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
# Keywords whose value is a schema or a list/map of schemas (the places ``$ref`` may appear), and the
# subset through which a value is produced without consuming output (a cycle through these alone has
# no finite JSON value).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "contains",
                  "propertyNames", "not", "if", "then", "else", "additionalItems")
_COUNTED = re.compile(r"(?<!\\)\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")

Kind = Literal["json_object", "json_schema", "regex", "choice", "structural_tag"]


class InvalidStructuredOutput(ValueError):
    """A constraint this server cannot compile; the message says why (the grammar engine's words
    where it refused)."""


class StructuredOutput(msgspec.Struct, frozen=True, kw_only=True):
    kind: Kind
    value: str = ""                       # json_schema: the schema's JSON text; regex: the pattern
    choices: tuple[str, ...] = ()         # choice: the allowed outputs

    def __post_init__(self) -> None:
        if self.kind in ("json_schema", "regex", "structural_tag"):
            if not isinstance(self.value, str) or not self.value:
                raise InvalidStructuredOutput(f"{self.kind}: must be a non-empty string")
            limit = MAX_TAG_CHARS if self.kind == "structural_tag" else MAX_SPEC_CHARS
            if len(self.value) > limit:
                raise InvalidStructuredOutput(f"{self.kind}: {len(self.value)} characters, at most "
                                              f"{limit} are accepted")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.value)
            except (ValueError, RecursionError) as exc:
                raise InvalidStructuredOutput(f"json_schema: not valid JSON ({exc})") from None
            check_schema(schema)
        if self.kind == "structural_tag":
            try:
                tag = json.loads(self.value)
            except (ValueError, RecursionError) as exc:
                raise InvalidStructuredOutput(f"structural_tag: not valid JSON ({exc})") from None
            if not isinstance(tag, dict) or tag.get("type") != "structural_tag":
                raise InvalidStructuredOutput('structural_tag: a JSON object of type "structural_tag"')
            for schema in _tag_schemas(tag):
                check_schema(schema)
        if self.kind == "regex" and (problem := _regex_problem(self.value)):
            raise InvalidStructuredOutput(f"regex: {problem}")
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
    def structural_tag(cls, tag: dict[str, Any]) -> StructuredOutput:
        return cls(kind="structural_tag", value=json.dumps(tag, ensure_ascii=False))

    @classmethod
    def json_object(cls) -> StructuredOutput:
        return cls(kind="json_object")

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        return cls(kind="regex", value=pattern)

    @classmethod
    def choice(cls, choices: list[str] | tuple[str, ...]) -> StructuredOutput:
        return cls(kind="choice", choices=tuple(choices))


def check_schema(schema: Any) -> None:
    """``InvalidStructuredOutput`` unless ``schema`` (decoded) is within the limits of this module."""
    if not isinstance(schema, (dict, bool)):
        raise InvalidStructuredOutput("json_schema: a schema is a JSON object")
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        raise InvalidStructuredOutput(f"json_schema: nested deeper than {MAX_SCHEMA_DEPTH} levels")
    if problem := _schema_problem(schema):
        raise InvalidStructuredOutput(f"json_schema: {problem}")


def _tag_schemas(tag: dict[str, Any]) -> list[Any]:
    """The JSON schemas of a structural tag's ``json_schema`` formats (walked without recursion; the
    tag itself nests a few levels per format, so its depth is not bounded by ``MAX_SCHEMA_DEPTH``)."""
    schemas, stack = [], [tag.get("format")]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            if node.get("type") == "json_schema":
                schemas.append(node.get("json_schema"))
            else:
                stack.extend(v for k, v in node.items() if k in ("content", "elements", "tags"))
    return schemas


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


def _regex_problem(pattern: str) -> str | None:
    """A counted repetition ``{m}``, ``{m,}`` or ``{m,n}`` past ``MAX_REPETITION``, or None."""
    for match in _COUNTED.finditer(pattern):
        for count in match.groups():
            if count and int(count) > MAX_REPETITION:
                return (f"the repetition count {match.group(0)} is larger than {MAX_REPETITION}, the largest "
                        "accepted")
    return None


def _subschemas(node: dict[str, Any]) -> list[tuple[str, Any, bool]]:
    """(keyword path, child schema, whether the child is produced without consuming output)."""
    out: list[tuple[str, Any, bool]] = []
    required = node.get("required") if isinstance(node.get("required"), list) else []
    for key in _SCHEMA_MAPS:
        value = node.get(key)
        if isinstance(value, dict):
            for name, child in value.items():
                out.append((f"{key}/{name}", child, key == "properties" and name in required))
    for key in _SCHEMA_LISTS:
        value = node.get(key)
        if isinstance(value, list):
            out.extend((f"{key}/{i}", child, key in ("allOf", "prefixItems") or len(value) == 1)
                       for i, child in enumerate(value))
    for key in _SCHEMA_VALUES:
        value = node.get(key)
        if isinstance(value, (dict, list)) and key != "not":
            mandatory = key in ("if", "then") or (key == "items" and _int(node.get("minItems")) > 0)
            if isinstance(value, list):
                out.extend((f"{key}/{i}", child, mandatory) for i, child in enumerate(value))
            else:
                out.append((key, value, mandatory))
    return out


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _schema_problem(root: Any) -> str | None:
    """Repetition keywords past ``MAX_REPETITION``, ``pattern`` counts past it, and ``$ref``s this
    server cannot compile faithfully: anything but a local JSON pointer (``#`` or ``#/...``), one that
    resolves to nothing, or a cycle of references through places a value cannot skip (``$ref``,
    ``allOf``, a single-branch ``anyOf``/``oneOf``, required properties, ``items`` with ``minItems``),
    which has no finite value. Recursion through optional places (an optional property, array items)
    is kept: the grammar represents it finitely."""
    if not isinstance(root, dict):
        return None
    nodes: dict[str, Any] = {}            # JSON pointer -> schema object
    edges: dict[str, list[str]] = {}      # pointer -> pointers reached without consuming output
    stack: list[tuple[str, Any]] = [("#", root)]
    refs: list[tuple[str, str]] = []
    while stack:
        pointer, node = stack.pop()
        if not isinstance(node, dict):
            continue
        nodes[pointer] = node
        for key in _REPETITION_KEYWORDS:
            value = node.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > MAX_REPETITION:
                return f"{key} {value} at {pointer} is larger than {MAX_REPETITION}, the largest accepted"
        if isinstance(node.get("pattern"), str) and (problem := _regex_problem(node["pattern"])):
            return f"pattern at {pointer}: {problem}"
        edges[pointer] = []
        if "$ref" in node:
            ref = node["$ref"]
            if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
                return (f"$ref {ref!r} at {pointer}: only local references (\"#\" or \"#/...\") are "
                        "supported; remote schemas are never fetched")
            refs.append((pointer, ref))
            edges[pointer].append(ref)
        for path, child, mandatory in _subschemas(node):
            child_pointer = f"{pointer}/{_escape(path)}" if "/" not in path else \
                f"{pointer}/" + "/".join(_escape(p) for p in path.split("/", 1))
            stack.append((child_pointer, child))
            if mandatory:
                edges[pointer].append(child_pointer)
    for pointer, ref in refs:
        if _normal(ref) not in nodes:
            return f"$ref {ref!r} at {pointer} points to nothing in the schema"
    # A cycle in ``edges`` (iterative depth-first search, colours: 1 on the stack, 2 done).
    colour: dict[str, int] = {}
    for start in edges:
        if colour.get(start):
            continue
        colour[start] = 1
        walk = [(start, iter(edges[start]))]
        while walk:
            pointer, it = walk[-1]
            nxt = next(it, None)
            if nxt is None:
                colour[pointer] = 2
                walk.pop()
                continue
            nxt = _normal(nxt)
            if colour.get(nxt) == 1:
                return (f"$ref cycle through {nxt}: the schema refers to itself with nothing in between "
                        "that a value can leave out, so no finite JSON value matches it")
            if not colour.get(nxt) and nxt in edges:
                colour[nxt] = 1
                walk.append((nxt, iter(edges[nxt])))
    return None


def _escape(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


def _normal(ref: str) -> str:
    return ref.rstrip("/") or "#"
