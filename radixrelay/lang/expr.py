"""What a program appends to a state: text, ``gen``, ``select`` and chat-role blocks.

The constructors validate their arguments at once and raise ``ProgramError`` naming the program
line, so a bad choice list fails where it is written, before any request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Union

from radixrelay.lang.errors import ProgramError, caller_origin
from radixrelay.structured.spec import StructuredOutput

Role = Literal["system", "user", "assistant"]


@dataclass(frozen=True)
class Gen:
    """Generate text after the state's text; stored under ``name`` and appended to the text
    (with ``n > 1`` the variable holds the list of ``n`` completions and the text is unchanged)."""

    name: str | None
    max_tokens: int
    stop: tuple[str, ...]
    temperature: float | None
    top_p: float | None
    n: int
    # Output constraint (at most one), sent as the server's guided_regex / guided_json / guided_choice.
    structured: StructuredOutput | None = None


@dataclass(frozen=True)
class Select:
    """Append the choice with the highest mean log-probability of its tokens after the text."""

    name: str | None
    choices: tuple[str, ...]


@dataclass(frozen=True)
class RoleBlock:
    """One chat message: the role's begin marker, the content items, the role's end marker."""

    role: Role
    content: tuple[Item, ...]


@dataclass(frozen=True)
class RoleEdge:
    """The begin or end marker of a role alone, for a message built over several operations
    (e.g. forks inside one assistant turn)."""

    role: Role
    begin: bool


Item = Union[str, Gen, Select]
Expr = Union[str, Gen, Select, RoleBlock, RoleEdge]


def gen(name: str | None = None, *, max_tokens: int = 128, stop: str | Sequence[str] | None = None,
        temperature: float | None = None, top_p: float | None = None, n: int = 1,
        regex: str | None = None, json_schema: dict[str, Any] | str | None = None,
        choices: Sequence[str] | None = None) -> Gen:
    """``temperature`` / ``top_p`` left as None use the backend's defaults. At most one constraint:
    ``regex`` (the output matches it in full), ``json_schema`` (the output is JSON valid against it)
    or ``choices`` (the output is one of them, generated; ``select`` instead scores each choice)."""
    if max_tokens < 1:
        raise _invalid(f"gen: max_tokens must be >= 1, got {max_tokens}")
    if n < 1:
        raise _invalid(f"gen: n must be >= 1, got {n}")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if any(not isinstance(s, str) or not s for s in stops):
        raise _invalid(f"gen: stop strings must be non-empty strings, got {stop!r}")
    if temperature is not None and temperature < 0:
        raise _invalid(f"gen: temperature must be >= 0, got {temperature}")
    if top_p is not None and not 0 < top_p <= 1:
        raise _invalid(f"gen: top_p must be in (0, 1], got {top_p}")
    return Gen(name, max_tokens, stops, temperature, top_p, n, _constraint(regex, json_schema, choices))


def _constraint(regex: str | None, json_schema: dict[str, Any] | str | None,
                choices: Sequence[str] | None) -> StructuredOutput | None:
    given = [name for name, value in (("regex", regex), ("json_schema", json_schema), ("choices", choices))
             if value is not None]
    if len(given) > 1:
        raise _invalid(f"gen: at most one of regex, json_schema and choices, got {', '.join(given)}")
    if isinstance(choices, str):
        raise _invalid("gen: choices must be a list of strings, not one string")
    try:
        if regex is not None:
            return StructuredOutput.regex(regex)
        if json_schema is not None:
            return StructuredOutput.json_schema(json_schema)
        if choices is not None:
            return StructuredOutput.choice(tuple(choices))
    except (ValueError, TypeError, RecursionError) as exc:
        raise _invalid(f"gen: {exc}") from None
    return None


def select(name: str | None = None, *, choices: Sequence[str]) -> Select:
    if isinstance(choices, str):
        raise _invalid("select: choices must be a list of strings, not one string")
    options = tuple(choices)
    if not options:
        raise _invalid("select: choices is empty")
    bad = [c for c in options if not isinstance(c, str) or not c]
    if bad:
        raise _invalid(f"select: every choice must be a non-empty string, got {bad[0]!r}")
    if len(set(options)) != len(options):
        raise _invalid(f"select: choices repeat: {list(options)}")
    return Select(name, options)


def _role(role: Role, content: Item | Sequence[Item]) -> RoleBlock:
    items = (content,) if isinstance(content, (str, Gen, Select)) else tuple(content)
    for item in items:
        if isinstance(item, Gen) and item.n != 1:
            raise _invalid(f"{role}: a gen inside a role block needs n=1")
        if not isinstance(item, (str, Gen, Select)):
            raise _invalid(f"{role}: content items are text, gen or select, got {type(item).__name__}")
    return RoleBlock(role, items)


def system(content: Item | Sequence[Item]) -> RoleBlock:
    return _role("system", content)


def user(content: Item | Sequence[Item]) -> RoleBlock:
    return _role("user", content)


def assistant(content: Item | Sequence[Item]) -> RoleBlock:
    return _role("assistant", content)


def assistant_begin() -> RoleEdge:
    return RoleEdge("assistant", begin=True)


def assistant_end() -> RoleEdge:
    return RoleEdge("assistant", begin=False)


def _invalid(reason: str) -> ProgramError:
    return ProgramError(caller_origin(), reason)
