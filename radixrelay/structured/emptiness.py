"""Whether a compiled grammar's language is empty: no finite output satisfies the constraint.

A JSON schema like ``{"anyOf": [{"$ref": "#"}, {"$ref": "#"}]}`` compiles (xgrammar accepts it) but
no JSON value matches it: every rule reachable from its root refers back to itself before anything
is produced. Served as it is, the model finds no token the grammar allows and the request ends at
once with empty content. The same holds deeper down (``items`` that can only refer to themselves
under ``minItems: 1``: ``[`` is allowed, then nothing) and for patterns no character matches
(``[^\\s\\S]``).

``language_is_empty`` reads the grammar as xgrammar prints it (its EBNF: rules ``name ::= body``,
one a line, with strings, character classes, rule references, groups, ``|``, ``*``/``+``/``?`` and
counted repetitions ``{m, n}``, ``Regex("...")`` elements, and lookahead assertions ``(= ...)``)
and computes which rules are productive (derive some finite string) by the usual fixed point: a
string is, a character class is unless it holds no character, a ``Regex`` element is unless its
pattern's own grammar is empty, a reference is if its rule is, a sequence if all its parts are, a
choice if one branch is, a repetition that may repeat zero times always is. The language is empty
when the root rule is not productive. Lookaheads are ignored (they only narrow what follows), so the
answer errs towards "not empty": a constraint is never refused for a limitation of this reading.
Text it cannot read (a construct of a later xgrammar) gives None: unknown.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

MAX_CODEPOINT = 0x10FFFF
RegexCheck = Callable[[str], "bool | None"]     # a pattern -> whether no string matches it (None: unknown)

_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<define>::=)
  | (?P<look>\(=)
  | (?P<open>\()
  | (?P<close>\))
  | (?P<bar>\|)
  | (?P<quant>[*+?])
  | (?P<count>\{\s*(?P<min>\d+)\s*(?:,\s*(?P<max>-?\d*)\s*)?\})
  | (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<cls>\[(?:[^\]\\]|\\.)*\])
  | (?P<regex>Regex\()
  | (?P<comma>,)
  | (?P<equals>=)
  | (?P<number>-?\d+(?:\.\d+)?)
  | (?P<name>[A-Za-z_][\w.\-]*)
""", re.VERBOSE | re.DOTALL)
_SIMPLE_ESCAPES = {"n": 0x0A, "r": 0x0D, "t": 0x09, "f": 0x0C, "v": 0x0B, "0": 0x00, "b": 0x08, "a": 0x07,
                   "e": 0x1B}


class Unreadable(ValueError):
    """Grammar text outside the EBNF subset read here."""


# Expressions: a choice is a tuple of sequences; a sequence a tuple of (atom, may be absent);
# an atom is True (a string or a non-empty class), False (an empty class), a rule name, or a choice.


@dataclass(frozen=True)
class _Token:
    kind: str
    text: str
    min: int = 0


def language_is_empty(grammar_text: str, root: str = "root", regex_is_empty: RegexCheck | None = None) -> bool | None:
    """True when no finite string derives from ``root`` in ``grammar_text`` (xgrammar's printed
    EBNF), False when one does, None when the text cannot be read. ``regex_is_empty`` judges the
    pattern of a ``Regex("...")`` element (a JSON schema's ``pattern``); without it, or when it
    answers None, such an element counts as productive."""
    try:
        rules = parse_rules(grammar_text, regex_is_empty)
    except (ValueError, RecursionError):            # Unreadable, or an escape past the code points
        return None
    if root not in rules:
        return None
    return root not in productive_rules(rules)


def parse_rules(text: str, regex_is_empty: RegexCheck | None = None) -> dict[str, tuple]:
    """``name -> choice`` for each line ``name ::= body [(= lookahead)]``."""
    rules: dict[str, tuple] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        tokens = _tokens(line)
        if len(tokens) < 3 or tokens[0].kind != "name" or tokens[1].kind != "define":
            raise Unreadable(f"not a rule: {line[:80]!r}")
        parser = _Parser(tokens, 2, regex_is_empty)
        body = parser.choice()
        if parser.peek("look"):                      # a lookahead assertion: read, then ignored
            parser.pos += 1
            parser.choice()
            parser.expect("close")
        if parser.pos != len(tokens):
            raise Unreadable(f"unexpected {tokens[parser.pos].text!r} in {line[:80]!r}")
        rules[tokens[0].text] = body
    return rules


def productive_rules(rules: dict[str, tuple]) -> set[str]:
    """The rules that derive some finite string (a fixed point over the rules, references to rules
    not defined counted as productive)."""
    productive: set[str] = set()
    changed = True
    while changed:                    # rules are printed root first: the last ones settle first
        changed = False
        for name, body in reversed(rules.items()):
            if name not in productive and _choice_ok(body, productive, rules):
                productive.add(name)
                changed = True
    return productive


def _choice_ok(choice: tuple, productive: set[str], rules: dict[str, tuple]) -> bool:
    return any(all(optional or _atom_ok(atom, productive, rules) for atom, optional in seq) for seq in choice)


def _atom_ok(atom: object, productive: set[str], rules: dict[str, tuple]) -> bool:
    if isinstance(atom, bool):
        return atom
    if isinstance(atom, str):
        return atom in productive or atom not in rules
    return _choice_ok(atom, productive, rules)


class _Parser:
    def __init__(self, tokens: list[_Token], pos: int, regex_is_empty: RegexCheck | None) -> None:
        self.tokens, self.pos = tokens, pos
        self.regex_is_empty = regex_is_empty

    def peek(self, kind: str) -> bool:
        return self.pos < len(self.tokens) and self.tokens[self.pos].kind == kind

    def expect(self, kind: str) -> None:
        if not self.peek(kind):
            raise Unreadable(f"expected {kind}")
        self.pos += 1

    def choice(self) -> tuple:
        branches = [self.sequence()]
        while self.peek("bar"):
            self.pos += 1
            branches.append(self.sequence())
        return tuple(branches)

    def sequence(self) -> tuple:
        items = []
        while self.pos < len(self.tokens) and self.tokens[self.pos].kind in ("string", "cls", "name", "open", "regex"):
            atom = self.atom()
            optional = False
            while self.peek("quant") or self.peek("count"):
                token = self.tokens[self.pos]
                self.pos += 1
                optional = optional or token.text in ("*", "?") or (token.kind == "count" and token.min == 0)
            items.append((atom, optional))
        return tuple(items)

    def atom(self) -> object:
        token = self.tokens[self.pos]
        self.pos += 1
        if token.kind == "string":
            return True
        if token.kind == "cls":
            return not class_is_empty(token.text)
        if token.kind == "name":
            return token.text
        if token.kind == "regex":
            return self.regex_call()
        body = self.choice()                             # "(" choice ")"
        self.expect("close")
        return body

    def regex_call(self) -> bool:
        """``Regex("pattern", name=value, ...)`` after its opening: whether it may match something."""
        if not self.peek("string"):
            raise Unreadable("Regex( without a pattern")
        pattern = unescape_string(self.tokens[self.pos].text)
        self.pos += 1
        while self.peek("comma"):                        # named arguments: json_string=true, ...
            self.pos += 1
            self.expect("name")
            self.expect("equals")
            if not any(self.peek(kind) for kind in ("name", "string", "number")):
                raise Unreadable("a Regex( argument without a value")
            self.pos += 1
        self.expect("close")
        return self.regex_is_empty is None or self.regex_is_empty(pattern) is not True


def _tokens(line: str) -> list[_Token]:
    out: list[_Token] = []
    pos = 0
    while pos < len(line):
        match = _TOKEN.match(line, pos)
        if match is None:
            raise Unreadable(f"cannot read {line[pos:pos + 20]!r}")
        pos = match.end()
        kind = match.lastgroup
        if kind == "space":
            continue
        if kind in ("min", "max"):                       # inner groups of "count"
            kind = "count"
        out.append(_Token(kind, match.group(0), int(match.group("min")) if kind == "count" else 0))
    return out


def class_is_empty(text: str) -> bool:
    """Whether the character class ``[...]`` / ``[^...]`` (xgrammar's escapes) holds no character."""
    body = text[1:-1]
    negated = body.startswith("^")
    chars = _class_chars(body[1:] if negated else body)
    ranges: list[tuple[int, int]] = []
    i = 0
    while i < len(chars):
        low = _code(chars[i])
        if i + 2 < len(chars) and chars[i + 1] == "-":
            ranges.append((low, _code(chars[i + 2])))
            i += 3
        else:
            ranges.append((low, low))
            i += 1
    if not negated:
        return not ranges
    covered = 0                                          # the next code point not yet covered
    for low, high in sorted(ranges):
        if low > covered:
            return False
        covered = max(covered, high + 1)
    return covered > MAX_CODEPOINT


def unescape_string(literal: str) -> str:
    """The text of a string literal ``"..."`` as xgrammar prints it (C-style escapes)."""
    body, out, i = literal[1:-1], [], 0
    while i < len(body):
        if body[i] == "\\":
            if i + 1 >= len(body):
                raise Unreadable("a string ends in a backslash")
            code, i = _escape(body, i + 1)
            out.append(chr(code))
        else:
            out.append(body[i])
            i += 1
    return "".join(out)


def _code(char: int | str) -> int:
    return char if isinstance(char, int) else ord(char)


def _class_chars(body: str) -> list[int | str]:
    """The class body as code points, with an unescaped ``-`` between two of them kept as "-"."""
    out: list[int | str] = []
    i = 0
    while i < len(body):
        ch = body[i]
        if ch == "\\":
            if i + 1 >= len(body):
                raise Unreadable("a class ends in a backslash")
            code, i = _escape(body, i + 1)
            out.append(code)
            continue
        if ch == "-" and out and i + 1 < len(body) and not isinstance(out[-1], str):
            out.append("-")
        else:
            out.append(ord(ch))
        i += 1
    return out


def _escape(body: str, i: int) -> tuple[int, int]:
    """(code point, index after it) of the escape whose letter is at ``body[i]``."""
    letter = body[i]
    width = {"x": 2, "u": 4, "U": 8}.get(letter)
    if width is not None:
        digits = body[i + 1:i + 1 + width]
        if len(digits) != width or not all(c in "0123456789abcdefABCDEF" for c in digits):
            raise Unreadable(f"bad escape \\{letter}{digits}")
        return int(digits, 16), i + 1 + width
    return _SIMPLE_ESCAPES.get(letter, ord(letter)), i + 1
