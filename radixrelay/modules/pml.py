"""PML, the prompt markup language of modular prompt reuse (Prompt Cache, paper sections 3.2-3.4).

A *schema* declares reusable prompt modules and where they sit; a *prompt* imports some of them,
fills their parameters and adds new text. Both are XML::

    <schema name="cities">
      <system>You are a travel guide.</system>
      <module name="trip-plan">Plan a trip of <param name="duration" len="2"/> days.
        <module name="budget">Keep it cheap.</module>
      </module>
      <union>
        <module name="tokyo">Tokyo is ...</module>
        <module name="miami">Miami is ...</module>
      </union>
      <scaffold name="both" modules="trip-plan miami"/>
    </schema>

    <prompt schema="cities"><trip-plan duration="3"><budget/></trip-plan><miami/>Surf spots?</prompt>

How the pieces fit::

    parse_schema(xml) ──┐
    builder.schema(...) ┴─▶ Schema ──▶ validate(schema)       one validator for both ways in
    prompt_from_str(xml) ──┐
    prompt_from_json(obj) ─┴─▶ Prompt ──▶ validate_prompt(prompt)   shape only
                                          check_prompt(prompt, schema)  against its schema
                                          (= check_imports(prompt, name, module_index(schema)))
    to_pml(schema), prompt_to_pml(prompt): back to XML; parse(to_pml(x)) == x for valid x.

Text rule (the normal form every Schema and Prompt is in):
    * In XML a text node is a maximal run of character data between two tags; comments and
      processing instructions are removed first and do not split a run. Element text and tail text
      are both kept, verbatim (no stripping), in document order.
    * A text node made only of XML whitespace (space, tab, CR, LF) is dropped: it is layout, not
      content. Text that contains anything else is kept whole, whitespace included.
    * Adjacent text nodes left after that (e.g. around a ``<scaffold>``, which is not a child in the
      AST) are merged into one. So no ``children`` tuple holds an empty or whitespace-only Text, nor
      two Texts in a row; validate() rejects ASTs that break this (the builder normalises for you,
      see ``merge_text``). The same holds for prompts, XML or JSON.
    * Text must consist of XML 1.0 characters (no NUL or other C0 controls but tab/LF/CR), so every
      valid AST can be written as PML and read back.

Names of schemas, modules, params and scaffolds match ``[A-Za-z_][A-Za-z0-9_.-]*``, are at most
``Limits.max_name_len`` long and are not ``xmlns`` (it would turn a prompt attribute into a
namespace declaration). Module names are global within a schema (prompts refer to them by name) and
may not be a role name (``<user/>`` in a prompt is a role). Param names are per module.

Prompts against a schema (check_prompt): a nested module is imported inside its parent's import;
each module at most once; at most one member of a union; args name params of that module. A param
without a value is allowed: its placeholder tokens stay, as the paper's "buffer" use expects. The
length of a value is checked in tokens by layout.SchemaLayout.prompt_plan, not here.

Security: documents are parsed by defusedxml's expat parser with DTDs, entity declarations and
external references forbidden; the byte size is checked before parsing; depth and element count
are checked while parsing (a streaming target), so a 100k-deep document stops after
``max_depth`` start tags and nothing recursive ever sees more than ``max_depth`` levels. Every bad
input raises SchemaError (a ValueError) naming the element and, for parsed XML, the line.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

from defusedxml import DTDForbidden, EntitiesForbidden, ExternalReferenceForbidden
from defusedxml.ElementTree import DefusedXMLParser, ParseError

# ──────────────────────────────────────────────────────────────────────────────── AST

RoleName = Literal["system", "user", "assistant"]
ROLES: tuple[str, ...] = get_args(RoleName)


def _line_field() -> int | None:
    # The source line of a parsed node: for messages only, ignored by == and hash().
    return field(default=None, compare=False, repr=False, kw_only=True)  # type: ignore[return-value]


@dataclass(frozen=True)
class Text:
    """Literal text, verbatim (see the text rule in the module docstring)."""

    text: str
    line: int | None = _line_field()


@dataclass(frozen=True)
class Param:
    """A placeholder of ``length`` tokens inside a module; a prompt may supply a value for it."""

    name: str
    length: int
    line: int | None = _line_field()


@dataclass(frozen=True)
class Role:
    """A chat role around its children. In a schema the children are Text/Param/Module/Union (Param
    only inside a module); in a prompt they are Text/Import. Roles never nest."""

    role: RoleName
    children: tuple[Node | PromptNode, ...]
    line: int | None = _line_field()


@dataclass(frozen=True)
class Module:
    """A reusable prompt module: its own text and params, plus nested modules and unions."""

    name: str
    children: tuple[Node, ...]
    line: int | None = _line_field()


@dataclass(frozen=True)
class Union:
    """Mutually exclusive modules: they share a start position; a prompt imports at most one."""

    members: tuple[Module, ...]
    line: int | None = _line_field()


@dataclass(frozen=True)
class Scaffold:
    """Modules encoded together (one attention span) in addition to separately."""

    name: str
    modules: tuple[str, ...]
    line: int | None = _line_field()


@dataclass(frozen=True)
class Schema:
    """A named document of modules. Scaffolds are kept apart from the children: in XML they may
    appear anywhere directly inside <schema>, and are written last."""

    name: str
    children: tuple[Node, ...]
    scaffolds: tuple[Scaffold, ...] = ()
    line: int | None = _line_field()


@dataclass(frozen=True)
class Import:
    """A module imported by a prompt; ``args`` are (param, value) pairs in the order written;
    ``children`` are the imports of its nested modules and new text."""

    name: str
    args: tuple[tuple[str, str], ...] = ()
    children: tuple[PromptNode, ...] = ()
    line: int | None = _line_field()


@dataclass(frozen=True)
class Prompt:
    """A request written against schema ``schema``."""

    schema: str
    parts: tuple[PromptNode, ...]
    line: int | None = _line_field()


Node = Text | Param | Role | Module | Union
PromptNode = Import | Text | Role


class SchemaError(ValueError):
    """Invalid PML (schema or prompt): the message names what is wrong and where."""


MAX_DEPTH_CAP = 200  # Limits.max_depth ceiling: the tree code recurses once per level


@dataclass(frozen=True)
class Limits:
    """Bounds on untrusted documents. Bytes count the UTF-8 encoding; depth counts elements, the
    root being depth 1; elements count XML elements (or AST nodes other than Text)."""

    max_bytes: int = 4 * 1024 * 1024
    max_depth: int = 32
    max_elements: int = 20_000
    max_param_len: int = 4096
    max_name_len: int = 128
    max_modules: int = 10_000

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_depth", "max_elements", "max_param_len", "max_name_len", "max_modules"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Limits.{name}: must be a positive integer, got {value!r}")
        if self.max_depth > MAX_DEPTH_CAP:
            raise ValueError(f"Limits.max_depth: at most {MAX_DEPTH_CAP}, got {self.max_depth}")


DEFAULT_LIMITS = Limits()

# ─────────────────────────────────────────────────────────────── names, text, messages

_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
_ILLEGAL_CHAR_RE = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
_XML_SPACE = " \t\r\n"


def _short(s: str, n: int = 40) -> str:
    return repr(s if len(s) <= n else s[:n] + "...")


def _clip(s: object, n: int = 40) -> str:
    # Names quoted in messages may be hostile (megabytes long): keep messages short.
    s = str(s)
    return s if len(s) <= n else s[:n] + "..."


def _at(node: object) -> str:
    line = getattr(node, "line", None)
    return f" (line {line})" if line is not None else ""


def _first(node: object) -> str:
    line = getattr(node, "line", None)
    return f" (first defined at line {line})" if line is not None else ""


def _desc(node: object) -> str:
    """How a node is named in messages, e.g. <module name='trip-plan'> (line 4)."""
    if isinstance(node, Module | Param | Scaffold | Schema):
        tag = type(node).__name__.lower()
        name = node.name if isinstance(node.name, str) else str(node.name)
        return f"<{tag} name={_short(name)}>{_at(node)}"
    if isinstance(node, Role):
        return f"<{_clip(node.role)}>{_at(node)}"
    if isinstance(node, Union):
        return f"<union>{_at(node)}"
    if isinstance(node, Import):
        return f"import <{_clip(node.name)}>{_at(node)}"
    if isinstance(node, Prompt):
        return f"<prompt schema={_short(str(node.schema))}>{_at(node)}"
    if isinstance(node, Text):
        return f"text {_short(node.text) if isinstance(node.text, str) else '?'}{_at(node)}"
    return type(node).__name__


def is_blank(text: str) -> bool:
    """True for text made only of XML whitespace (or empty): such text nodes are dropped."""
    return text.strip(_XML_SPACE) == ""


def merge_text(items: Iterable[object]) -> tuple:
    """Normal form of a children sequence: ``str`` becomes Text, blank Text is dropped, adjacent
    Texts are merged (the merged node keeps the first one's line). Other items pass unchanged."""
    out: list[object] = []
    run: list[Text] = []  # adjacent texts not yet merged (joined once: linear time)

    def flush() -> None:
        if run:
            out.append(run[0] if len(run) == 1 else Text("".join(t.text for t in run), line=run[0].line))
            run.clear()

    for item in items:
        if isinstance(item, str):
            item = Text(item)
        if isinstance(item, Text) and isinstance(item.text, str):
            if not is_blank(item.text):
                run.append(item)
            continue
        flush()
        out.append(item)
    flush()
    return tuple(out)


def _check_name(node: object, name: object, limits: Limits, what: str = "name") -> None:
    if not isinstance(name, str):
        raise SchemaError(f"{_desc(node)}: {what} must be a string, got {type(name).__name__}")
    if len(name) > limits.max_name_len:
        raise SchemaError(f"{_desc(node)}: {what} is longer than {limits.max_name_len} characters")
    if not _NAME_RE.fullmatch(name):
        raise SchemaError(f"{_desc(node)}: invalid {what} {_short(name)} (names match [A-Za-z_][A-Za-z0-9_.-]*)")
    if name == "xmlns":
        raise SchemaError(f"{_desc(node)}: {what} 'xmlns' is reserved by XML")


def _check_text(node: Text, where: str) -> None:
    if not isinstance(node.text, str):
        raise SchemaError(f"text in {where}: must be a string, got {type(node.text).__name__}")
    if is_blank(node.text):
        raise SchemaError(f"{_desc(node)} in {where}: empty or whitespace-only Text is not in normal form (drop it)")
    _check_chars(node.text, f"{_desc(node)} in {where}")


def _check_chars(text: str, where: str) -> None:
    bad = _ILLEGAL_CHAR_RE.search(text)
    if bad is not None:
        raise SchemaError(f"{where}: character U+{ord(bad.group()):04X} is not allowed in XML text")


def _check_tuple(owner: object, value: object, what: str) -> tuple:
    if not isinstance(value, tuple):
        raise SchemaError(f"{_desc(owner)}: {what} must be a tuple, got {type(value).__name__}")
    return value


# ──────────────────────────────────────────────────────────────── schema validation


@dataclass(frozen=True)
class ModuleInfo:
    """Where a module sits: its enclosing module, its union (index in document order, members
    share it), its params, and ``choices``: the (union, member index) choices on its path from the
    root; two modules whose choices differ for one union can never be imported together."""

    module: Module
    parent: str | None
    union: int | None
    params: tuple[str, ...]
    choices: tuple[tuple[int, int], ...]


class _SchemaChecker:
    """One pass over a Schema: every rule the parser and the builder share. Recursion is bounded:
    depth is checked before descending, and Limits caps max_depth."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.elements = 0
        self.unions = 0
        self.modules: dict[str, ModuleInfo] = {}

    def count(self, node: object, depth: int) -> None:
        self.elements += 1
        if self.elements > self.limits.max_elements:
            raise SchemaError(f"{_desc(node)}: more than {self.limits.max_elements} elements")
        if depth > self.limits.max_depth:
            raise SchemaError(f"{_desc(node)}: nested deeper than {self.limits.max_depth} elements")

    def run(self, schema: Schema) -> dict[str, ModuleInfo]:
        if not isinstance(schema, Schema):
            raise SchemaError(f"expected a Schema, got {type(schema).__name__}")
        self.count(schema, 1)
        _check_name(schema, schema.name, self.limits)
        where = f"<schema name={_short(schema.name)}>"
        self.children(schema, where, 2, module=None, params=None, role=None, choices=())
        self.scaffolds(schema)
        return self.modules

    def children(self, owner: object, where: str, depth: int, *, module: Module | None,
                 params: dict[str, Param] | None, role: Role | None,
                 choices: tuple[tuple[int, int], ...]) -> None:
        prev_text = False
        for child in _check_tuple(owner, owner.children, "children"):  # type: ignore[attr-defined]
            if isinstance(child, Text):
                _check_text(child, where)
                if prev_text:
                    raise SchemaError(f"{_desc(child)} in {where}: adjacent Text nodes must be merged into one")
                prev_text = True
                continue
            prev_text = False
            if not isinstance(child, Param | Role | Module | Union):
                raise SchemaError(f"{where}: unexpected child {type(child).__name__} (expected Text, Param, "
                                  "Role, Module or Union)")
            self.count(child, depth)
            if isinstance(child, Param):
                self.param(child, where, module, params)
            elif isinstance(child, Role):
                if child.role not in ROLES:
                    raise SchemaError(f"role {_short(str(child.role))}{_at(child)} in {where}: "
                                      f"roles are {', '.join(ROLES)}")
                if role is not None:
                    raise SchemaError(f"{_desc(child)} in {where}: roles cannot be nested (inside {_desc(role)})")
                self.children(child, f"{_desc(child)} in {where}", depth + 1, module=module, params=params,
                              role=child, choices=choices)
            elif isinstance(child, Module):
                self.module(child, depth, module, None, role, choices)
            else:
                self.union(child, where, depth, module, role, choices)

    def param(self, p: Param, where: str, module: Module | None, params: dict[str, Param] | None) -> None:
        if module is None or params is None:
            raise SchemaError(f"{_desc(p)} in {where}: <param> is only allowed inside a <module>")
        _check_name(p, p.name, self.limits)
        n = p.length
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.limits.max_param_len:
            shown = _short(n) if isinstance(n, str) else repr(n)
            raise SchemaError(f"{_desc(p)} in {_desc(module)}: len must be an integer from 1 to "
                              f"{self.limits.max_param_len}, got {shown}")
        first = params.get(p.name)
        if first is not None:
            raise SchemaError(f"{_desc(p)}: duplicate param name {p.name!r} in {_desc(module)}{_first(first)}")
        params[p.name] = p

    def module(self, m: Module, depth: int, parent: Module | None, union: int | None, role: Role | None,
               choices: tuple[tuple[int, int], ...]) -> None:
        _check_name(m, m.name, self.limits)
        if m.name in ROLES:
            raise SchemaError(f"{_desc(m)}: module name {m.name!r} is reserved for the role tag")
        first = self.modules.get(m.name)
        if first is not None:
            raise SchemaError(f"{_desc(m)}: duplicate module name {m.name!r}; module names are global within "
                              f"a schema{_first(first.module)}")
        if len(self.modules) >= self.limits.max_modules:
            raise SchemaError(f"{_desc(m)}: more than {self.limits.max_modules} modules")
        params: dict[str, Param] = {}
        # Registered before the children so a nested module reusing the name is caught at the child.
        self.modules[m.name] = ModuleInfo(m, parent.name if parent else None, union, (), choices)
        self.children(m, _desc(m), depth + 1, module=m, params=params, role=role, choices=choices)
        self.modules[m.name] = ModuleInfo(m, parent.name if parent else None, union, tuple(params), choices)

    def union(self, u: Union, where: str, depth: int, parent: Module | None, role: Role | None,
              choices: tuple[tuple[int, int], ...]) -> None:
        uid = self.unions
        self.unions += 1
        members = _check_tuple(u, u.members, "members")
        if not members:
            raise SchemaError(f"{_desc(u)} in {where}: a union needs at least one <module> member")
        for i, member in enumerate(members):
            if not isinstance(member, Module):
                raise SchemaError(f"{_desc(u)} in {where}: union members must be modules, "
                                  f"got {type(member).__name__} at index {i}")
            self.count(member, depth + 1)
            self.module(member, depth + 1, parent, uid, role, choices + ((uid, i),))

    def scaffolds(self, schema: Schema) -> None:
        seen: dict[str, Scaffold] = {}
        for s in _check_tuple(schema, schema.scaffolds, "scaffolds"):
            if not isinstance(s, Scaffold):
                raise SchemaError(f"{_desc(schema)}: scaffolds must be Scaffold, got {type(s).__name__}")
            self.count(s, 2)
            _check_name(s, s.name, self.limits)
            if s.name in seen:
                raise SchemaError(f"{_desc(s)}: duplicate scaffold name {s.name!r}")
            seen[s.name] = s
            names = _check_tuple(s, s.modules, "modules")
            listed: set[str] = set()
            for name in names:
                if not isinstance(name, str) or name not in self.modules:
                    raise SchemaError(f"{_desc(s)}: unknown module {_short(str(name))}")
                if name in listed:
                    raise SchemaError(f"{_desc(s)}: module {name!r} is listed twice")
                listed.add(name)
            if len(names) < 2:
                raise SchemaError(f"{_desc(s)}: a scaffold needs at least 2 modules, got {len(names)}")
            picked: dict[int, tuple[int, str]] = {}  # union -> (member index, first module choosing it)
            for name in names:
                for uid, member in self.modules[name].choices:
                    other = picked.setdefault(uid, (member, name))
                    if other[0] != member:
                        raise SchemaError(f"{_desc(s)}: modules {other[1]!r} and {name!r} are in different members "
                                          "of one union and can never be imported together")


def validate(schema: Schema, limits: Limits | None = None) -> None:
    """Raise SchemaError unless ``schema`` is a valid schema in normal form (see module docstring).
    The one validator behind parse_schema and builder.schema."""
    _SchemaChecker(limits or DEFAULT_LIMITS).run(schema)


def module_index(schema: Schema, limits: Limits | None = None) -> dict[str, ModuleInfo]:
    """Validate ``schema`` and return its modules by name, in document order."""
    return _SchemaChecker(limits or DEFAULT_LIMITS).run(schema)


# ─────────────────────────────────────────────────────────────── prompt validation


class _PromptChecker:
    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.elements = 0

    def count(self, node: object, depth: int) -> None:
        self.elements += 1
        if self.elements > self.limits.max_elements:
            raise SchemaError(f"{_desc(node)}: more than {self.limits.max_elements} elements")
        if depth > self.limits.max_depth:
            raise SchemaError(f"{_desc(node)}: nested deeper than {self.limits.max_depth} elements")

    def run(self, prompt: Prompt) -> None:
        if not isinstance(prompt, Prompt):
            raise SchemaError(f"expected a Prompt, got {type(prompt).__name__}")
        self.count(prompt, 1)
        _check_name(prompt, prompt.schema, self.limits, "schema name")
        self.parts(_check_tuple(prompt, prompt.parts, "parts"), _desc(prompt), 2, role=None, inside=None)

    def parts(self, parts: tuple, where: str, depth: int, *, role: Role | None,
              inside: Import | None) -> None:
        prev_text = False
        for part in parts:
            if isinstance(part, Text):
                _check_text(part, where)
                if prev_text:
                    raise SchemaError(f"{_desc(part)} in {where}: adjacent Text nodes must be merged into one")
                prev_text = True
                continue
            prev_text = False
            if isinstance(part, Role):
                self.count(part, depth)
                if part.role not in ROLES:
                    raise SchemaError(f"role {_short(str(part.role))}{_at(part)} in {where}: "
                                      f"roles are {', '.join(ROLES)}")
                if role is not None:
                    raise SchemaError(f"{_desc(part)} in {where}: roles cannot be nested (inside {_desc(role)})")
                if inside is not None:
                    raise SchemaError(f"{_desc(part)} in {where}: roles are not allowed inside an import")
                self.parts(_check_tuple(part, part.children, "children"), f"{_desc(part)} in {where}",
                           depth + 1, role=part, inside=None)
            elif isinstance(part, Import):
                self.count(part, depth)
                self.import_(part, depth, role)
            else:
                raise SchemaError(f"{where}: unexpected part {type(part).__name__} (expected Text, Import or Role)")

    def import_(self, imp: Import, depth: int, role: Role | None) -> None:
        _check_name(imp, imp.name, self.limits, "module name")
        seen: set[str] = set()
        for pair in _check_tuple(imp, imp.args, "args"):
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise SchemaError(f"{_desc(imp)}: args must be (name, value) pairs, got {pair!r}")
            key, value = pair
            _check_name(imp, key, self.limits, "param name")
            if key in seen:
                raise SchemaError(f"{_desc(imp)}: param {key!r} given twice")
            seen.add(key)
            if not isinstance(value, str):
                raise SchemaError(f"{_desc(imp)}: value of param {key!r} must be a string, got {type(value).__name__}")
            _check_chars(value, f"{_desc(imp)}: value of param {key!r}")
        self.parts(_check_tuple(imp, imp.children, "children"), _desc(imp), depth + 1, role=role, inside=imp)


def validate_prompt(prompt: Prompt, limits: Limits | None = None) -> None:
    """Raise SchemaError unless ``prompt`` is well formed (names, nesting, normal form, limits)."""
    _PromptChecker(limits or DEFAULT_LIMITS).run(prompt)


def check_prompt(prompt: Prompt, schema: Schema, limits: Limits | None = None) -> None:
    """Raise SchemaError unless ``prompt`` is a valid request against ``schema`` (rules in the module
    docstring; a param left without a value is allowed and keeps its placeholder)."""
    validate_prompt(prompt, limits)
    check_imports(prompt, schema.name, module_index(schema, limits))


def check_imports(prompt: Prompt, schema_name: str, index: Mapping[str, ModuleInfo]) -> None:
    """check_prompt for a prompt already shape-checked (validate_prompt) and a schema already indexed
    (module_index): what a server runs per request without re-validating the schema."""
    if prompt.schema != schema_name:
        raise SchemaError(f"{_desc(prompt)}: written against schema {prompt.schema!r}, not {schema_name!r}")
    imported: dict[str, Import] = {}
    union_pick: dict[int, str] = {}

    def walk(parts: tuple, parent: Import | None) -> None:
        for part in parts:
            if isinstance(part, Role):
                walk(part.children, parent)
            elif isinstance(part, Import):
                check_import(part, parent)
                walk(part.children, part)

    def check_import(imp: Import, parent: Import | None) -> None:
        info = index.get(imp.name)
        if info is None:
            raise SchemaError(f"{_desc(imp)}: unknown module {imp.name!r} in schema {schema_name!r}")
        here = parent.name if parent else None
        if info.parent != here:
            if info.parent is None:
                raise SchemaError(f"{_desc(imp)}: module {imp.name!r} is not nested in {here!r}; import it at "
                                  "the top level of the prompt")
            raise SchemaError(f"{_desc(imp)}: module {imp.name!r} is nested in {info.parent!r} and must be "
                              f"imported inside <{info.parent}>")
        if imp.name in imported:
            raise SchemaError(f"{_desc(imp)}: module {imp.name!r} is imported twice")
        imported[imp.name] = imp
        if info.union is not None:
            other = union_pick.setdefault(info.union, imp.name)
            if other != imp.name:
                raise SchemaError(f"{_desc(imp)}: modules {other!r} and {imp.name!r} are members of the same "
                                  "union; a prompt imports at most one of them")
        for key, _ in imp.args:
            if key not in info.params:
                if not info.params:
                    raise SchemaError(f"{_desc(imp)}: module {imp.name!r} has no parameters, got a value for {key!r}")
                raise SchemaError(f"{_desc(imp)}: module {imp.name!r} has no parameter {key!r} "
                                  f"(it has: {', '.join(info.params)})")

    walk(prompt.parts, None)


# ──────────────────────────────────────────────────────────────────────── XML parsing


class _Elem:
    """A parsed element before conversion: ``items`` are text runs and child elements in order."""

    __slots__ = ("tag", "attrib", "line", "items")

    def __init__(self, tag: str, attrib: dict[str, str], line: int | None) -> None:
        self.tag = tag
        self.attrib = attrib
        self.line = line
        self.items: list[str | _Elem] = []


class _Collector:
    """Streaming target of the defused expat parser. Limits are enforced as each start tag arrives,
    so a hostile document is rejected after at most max_depth / max_elements of them. Text arrives
    in chunks; they are joined once per run (at the next tag)."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.parser: DefusedXMLParser | None = None
        self.stack: list[_Elem] = []
        self.root: _Elem | None = None
        self.count = 0
        self.chunks: list[str] = []

    def _line(self) -> int | None:
        return self.parser.parser.CurrentLineNumber if self.parser is not None else None

    def _flush(self) -> None:
        if self.chunks:
            if self.stack:
                self.stack[-1].items.append("".join(self.chunks))
            self.chunks = []

    def start(self, tag: str, attrib: Mapping[str, str]) -> None:
        self._flush()
        self.count += 1
        line = self._line()
        if self.count > self.limits.max_elements:
            raise SchemaError(f"<{_clip(tag)}> (line {line}): more than {self.limits.max_elements} elements")
        if len(self.stack) >= self.limits.max_depth:
            raise SchemaError(f"<{_clip(tag)}> (line {line}): nested deeper than {self.limits.max_depth} elements")
        elem = _Elem(tag, dict(attrib), line)
        if self.stack:
            self.stack[-1].items.append(elem)
        else:
            self.root = elem
        self.stack.append(elem)

    def end(self, tag: str) -> None:
        self._flush()
        self.stack.pop()

    def data(self, text: str) -> None:
        self.chunks.append(text)

    def close(self) -> _Elem | None:
        return self.root


def _to_text(source: str | bytes, limits: Limits) -> str:
    """The document as str, size checked before any parsing; bytes must be UTF-8 (BOM allowed)."""
    if isinstance(source, bytearray | memoryview):
        source = bytes(source)
    if isinstance(source, bytes):
        if len(source) > limits.max_bytes:
            raise SchemaError(f"document is {len(source)} bytes, more than the limit of {limits.max_bytes}")
        try:
            return source.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            raise SchemaError(f"document is not valid UTF-8 (byte {e.start})") from None
    if isinstance(source, str):
        if len(source) > limits.max_bytes:  # every char is at least one byte
            raise SchemaError(f"document is more than the limit of {limits.max_bytes} bytes")
        try:
            n = len(source.encode("utf-8"))
        except UnicodeEncodeError as e:
            raise SchemaError(f"document is not valid Unicode (lone surrogate at character {e.start})") from None
        if n > limits.max_bytes:
            raise SchemaError(f"document is {n} bytes, more than the limit of {limits.max_bytes}")
        return source
    raise SchemaError(f"a PML document must be str or bytes, got {type(source).__name__}")


def _parse_xml(source: str | bytes, limits: Limits) -> _Elem:
    text = _to_text(source, limits)
    target = _Collector(limits)
    parser = DefusedXMLParser(target=target, forbid_dtd=True, forbid_entities=True, forbid_external=True)
    target.parser = parser
    try:
        parser.feed(text)  # str input: expat reads it as UTF-8 whatever the XML declaration says
        root = parser.close()
    except DTDForbidden:
        raise SchemaError("DTDs (<!DOCTYPE ...>) are not allowed in PML") from None
    except EntitiesForbidden:
        raise SchemaError("entity declarations are not allowed in PML") from None
    except ExternalReferenceForbidden:
        raise SchemaError("external entity references are not allowed in PML") from None
    except ParseError as e:
        raise SchemaError(f"malformed XML: {e}") from None
    if root is None:
        raise SchemaError("empty document")
    return root


def _attrs(elem: _Elem, required: Sequence[str], optional: Sequence[str] = ()) -> dict[str, str]:
    for key in elem.attrib:
        if key not in required and key not in optional:
            raise SchemaError(f"<{_clip(elem.tag)}> (line {elem.line}): unknown attribute {_short(key)}")
    for key in required:
        if key not in elem.attrib:
            raise SchemaError(f"<{_clip(elem.tag)}> (line {elem.line}): missing attribute {key!r}")
    return elem.attrib


def _empty(elem: _Elem) -> None:
    for item in elem.items:
        if isinstance(item, _Elem):
            raise SchemaError(f"<{_clip(elem.tag)}> (line {elem.line}) must be empty, "
                              f"got <{_clip(item.tag)}> (line {item.line})")
        if not is_blank(item):
            raise SchemaError(f"<{_clip(elem.tag)}> (line {elem.line}) must be empty, got text {_short(item)}")


_INT_RE = re.compile(r"-?[0-9]{1,12}")


def _schema_children(elem: _Elem, top: bool) -> tuple[tuple, list[Scaffold]]:
    children: list[object] = []
    scaffolds: list[Scaffold] = []
    for item in elem.items:
        if isinstance(item, str):
            children.append(Text(item))
            continue
        tag, line = item.tag, item.line
        if tag == "module":
            name = _attrs(item, ("name",))["name"]
            kids, _ = _schema_children(item, top=False)
            children.append(Module(name, kids, line=line))
        elif tag == "param":
            attrib = _attrs(item, ("name", "len"))
            _empty(item)
            raw = attrib["len"]
            if not _INT_RE.fullmatch(raw):
                if re.fullmatch(r"-?[0-9]+", raw):
                    raise SchemaError(f"<param name={_short(attrib['name'])}> (line {line}): len is too large, "
                                      f"got {_short(raw)}")
                raise SchemaError(f"<param name={_short(attrib['name'])}> (line {line}): len must be an integer, "
                                  f"got {_short(raw)}")
            children.append(Param(attrib["name"], int(raw), line=line))
        elif tag in ROLES:
            _attrs(item, ())
            kids, _ = _schema_children(item, top=False)
            children.append(Role(tag, kids, line=line))  # type: ignore[arg-type]
        elif tag == "union":
            _attrs(item, ())
            members: list[Module] = []
            for sub in item.items:
                if isinstance(sub, str):
                    if not is_blank(sub):
                        raise SchemaError(f"<union> (line {line}): only <module> elements are allowed inside "
                                          f"<union>, got text {_short(sub)}")
                    continue
                if sub.tag != "module":
                    raise SchemaError(f"<union> (line {line}): only <module> elements are allowed inside <union>, "
                                      f"got <{_clip(sub.tag)}> (line {sub.line})")
                name = _attrs(sub, ("name",))["name"]
                kids, _ = _schema_children(sub, top=False)
                members.append(Module(name, kids, line=sub.line))
            children.append(Union(tuple(members), line=line))
        elif tag == "scaffold":
            if not top:
                raise SchemaError(f"<scaffold> (line {line}): allowed only directly inside <schema>, "
                                  f"not inside <{_clip(elem.tag)}>")
            attrib = _attrs(item, ("name", "modules"))
            _empty(item)
            scaffolds.append(Scaffold(attrib["name"], tuple(attrib["modules"].split()), line=line))
        else:
            raise SchemaError(f"<{_clip(tag)}> (line {line}): unknown element inside <{_clip(elem.tag)}> "
                              "(expected module, param, union, scaffold, system, user or assistant)")
    return merge_text(children), scaffolds


def param_positions(nodes: Sequence[object]) -> int:
    """Positions the params of ``nodes`` take at the least (the members of a union share theirs):
    a lower bound of a schema's ``end_position``, known without tokenizing its text."""
    total = 0
    for node in nodes:
        if isinstance(node, Param):
            total += node.length
        elif isinstance(node, Union):
            total += max((param_positions([m]) for m in node.members), default=0)
        elif isinstance(node, (Module, Role)):
            total += param_positions(node.children)
    return total


def parse_schema(source: str | bytes, limits: Limits | None = None) -> Schema:
    """Parse and validate a PML schema document; SchemaError for anything invalid or hostile."""
    limits = limits or DEFAULT_LIMITS
    root = _parse_xml(source, limits)
    if root.tag != "schema":
        raise SchemaError(f"<{_clip(root.tag)}> (line {root.line}): a schema document's root must be <schema>")
    name = _attrs(root, ("name",))["name"]
    children, scaffolds = _schema_children(root, top=True)
    schema = Schema(name, children, tuple(scaffolds), line=root.line)
    validate(schema, limits)
    return schema


def _prompt_parts(elem: _Elem) -> tuple:
    parts: list[object] = []
    for item in elem.items:
        if isinstance(item, str):
            parts.append(Text(item))
        elif item.tag in ROLES:
            _attrs(item, ())
            parts.append(Role(item.tag, _prompt_parts(item), line=item.line))  # type: ignore[arg-type]
        else:
            if item.tag.startswith("{"):
                raise SchemaError(f"<{_clip(item.tag)}> (line {item.line}): XML namespaces are not part of PML")
            for key in item.attrib:
                if key.startswith("{"):
                    raise SchemaError(f"<{_clip(item.tag)}> (line {item.line}): unknown attribute {_short(key)}")
            parts.append(Import(item.tag, tuple(item.attrib.items()), _prompt_parts(item), line=item.line))
    return merge_text(parts)


def prompt_from_str(source: str | bytes, limits: Limits | None = None) -> Prompt:
    """Parse a PML prompt (``<prompt schema="...">``) and check its shape (validate_prompt)."""
    limits = limits or DEFAULT_LIMITS
    root = _parse_xml(source, limits)
    if root.tag != "prompt":
        raise SchemaError(f"<{_clip(root.tag)}> (line {root.line}): a prompt document's root must be <prompt>")
    prompt = Prompt(_attrs(root, ("schema",))["schema"], _prompt_parts(root), line=root.line)
    validate_prompt(prompt, limits)
    return prompt


# ──────────────────────────────────────────────────────────────────────── JSON prompts

_JSON_KEYS = {"module": ("module", "args", "parts"), "text": ("text",), "role": ("role", "parts")}


def prompt_from_json(obj: object, limits: Limits | None = None) -> Prompt:
    """The HTTP form: ``{"schema": str, "parts": [part, ...]}`` where a part is one of
    ``{"module": str, "args"?: {str: str}, "parts"?: [...]}``, ``{"text": str}``,
    ``{"role": "system"|"user"|"assistant", "parts": [...]}``. Unknown keys are errors."""
    limits = limits or DEFAULT_LIMITS
    if not isinstance(obj, dict):
        raise SchemaError(f"prompt: expected a JSON object, got {type(obj).__name__}")
    for key in obj:
        if key not in ("schema", "parts"):
            raise SchemaError(f"prompt: unknown key {_short(str(key))}")
    schema = obj.get("schema")
    if not isinstance(schema, str):
        raise SchemaError("prompt.schema: expected a string")
    if "parts" not in obj:
        raise SchemaError("prompt: missing key 'parts'")
    counter = [0]
    prompt = Prompt(schema, _json_parts(obj["parts"], "parts", 2, limits, counter))
    validate_prompt(prompt, limits)
    return prompt


def _json_parts(value: object, path: str, depth: int, limits: Limits, counter: list[int]) -> tuple:
    if depth > limits.max_depth:
        raise SchemaError(f"{path}: nested deeper than {limits.max_depth} levels")
    if not isinstance(value, list):
        raise SchemaError(f"{path}: expected a list, got {type(value).__name__}")
    out: list[object] = []
    for i, part in enumerate(value):
        where = f"{path}[{i}]"
        counter[0] += 1
        if counter[0] > limits.max_elements:
            raise SchemaError(f"{where}: more than {limits.max_elements} parts")
        if not isinstance(part, dict):
            raise SchemaError(f"{where}: expected an object, got {type(part).__name__}")
        kinds = [k for k in _JSON_KEYS if k in part]
        if len(kinds) != 1:
            raise SchemaError(f"{where}: expected exactly one of 'module', 'text', 'role', "
                              f"got {sorted(map(str, part))}")
        kind = kinds[0]
        for key in part:
            if key not in _JSON_KEYS[kind]:
                raise SchemaError(f"{where}: unknown key {_short(str(key))} in a {kind} part")
        head = part[kind]
        if not isinstance(head, str):
            raise SchemaError(f"{where}.{kind}: expected a string, got {type(head).__name__}")
        if kind == "text":
            out.append(Text(head))
            continue
        kids = _json_parts(part.get("parts", []), f"{where}.parts", depth + 1, limits, counter)
        if kind == "role":
            if head not in ROLES:
                raise SchemaError(f"{where}.role: expected one of {', '.join(ROLES)}, got {_short(head)}")
            out.append(Role(head, kids))  # type: ignore[arg-type]
            continue
        args = part.get("args", {})
        if not isinstance(args, dict):
            raise SchemaError(f"{where}.args: expected an object, got {type(args).__name__}")
        for key, val in args.items():
            if not isinstance(val, str):
                raise SchemaError(f"{where}.args.{key}: expected a string, got {type(val).__name__}")
        out.append(Import(head, tuple(args.items()), kids))
    return merge_text(out)


# ──────────────────────────────────────────────────────────────────────── serialization


def _esc_text(s: str) -> str:
    # CR as a reference: a literal CR would be read back as LF (XML line-end normalisation).
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("\r", "&#13;")


def _esc_attr(s: str) -> str:
    # Tab/LF/CR as references: literal ones would be read back as spaces (attribute normalisation).
    return (s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")
            .replace("\t", "&#9;").replace("\n", "&#10;").replace("\r", "&#13;"))


def _start(tag: str, attrs: Iterable[tuple[str, str]]) -> str:
    return "<" + tag + "".join(f' {k}="{_esc_attr(v)}"' for k, v in attrs)


class _Writer:
    """Writes elements; with ``indent``, inserts layout whitespace only between two non-text
    neighbours (and after the start tag / before the end tag next to a non-text child), where the
    parser drops it as blank text, so the output reads back to the same AST."""

    def __init__(self, indent: str | None) -> None:
        self.indent = indent
        self.out: list[str] = []

    def element(self, tag: str, attrs: Iterable[tuple[str, str]], items: Sequence[object], level: int) -> None:
        self.out.append(_start(tag, attrs))
        if not items:
            self.out.append("/>")
            return
        self.out.append(">")
        prev_text = False
        for item in items:
            is_text = isinstance(item, Text)
            if self.indent is not None and not is_text and not prev_text:
                self.out.append("\n" + self.indent * (level + 1))
            self.node(item, level + 1)
            prev_text = is_text
        if self.indent is not None and not prev_text:
            self.out.append("\n" + self.indent * level)
        self.out.append(f"</{tag}>")

    def node(self, node: object, level: int) -> None:
        if isinstance(node, Text):
            self.out.append(_esc_text(node.text))
        elif isinstance(node, Param):
            self.element("param", (("name", node.name), ("len", str(node.length))), (), level)
        elif isinstance(node, Role):
            self.element(node.role, (), node.children, level)
        elif isinstance(node, Module):
            self.element("module", (("name", node.name),), node.children, level)
        elif isinstance(node, Union):
            self.element("union", (), node.members, level)
        elif isinstance(node, Scaffold):
            self.element("scaffold", (("name", node.name), ("modules", " ".join(node.modules))), (), level)
        elif isinstance(node, Import):
            self.element(node.name, node.args, node.children, level)
        else:  # unreachable after validation
            raise SchemaError(f"cannot write {type(node).__name__} as PML")


def to_pml(schema: Schema, *, indent: str | None = "  ", limits: Limits | None = None) -> str:
    """The schema as a PML document (validated first); ``parse_schema(to_pml(s)) == s``.
    ``indent=None`` writes no layout whitespace at all."""
    validate(schema, limits)
    w = _Writer(indent)
    w.element("schema", (("name", schema.name),), (*schema.children, *schema.scaffolds), 0)
    return "".join(w.out)


def prompt_to_pml(prompt: Prompt, *, indent: str | None = None, limits: Limits | None = None) -> str:
    """The prompt as a PML document (shape validated first); ``prompt_from_str`` reads it back."""
    validate_prompt(prompt, limits)
    w = _Writer(indent)
    w.element("prompt", (("schema", prompt.schema),), prompt.parts, 0)
    return "".join(w.out)


def prompt_to_json(prompt: Prompt, limits: Limits | None = None) -> dict:
    """The JSON form read by ``prompt_from_json``."""
    validate_prompt(prompt, limits)

    def parts(nodes: Iterable[object]) -> list[dict]:
        out: list[dict] = []
        for n in nodes:
            if isinstance(n, Text):
                out.append({"text": n.text})
            elif isinstance(n, Role):
                out.append({"role": n.role, "parts": parts(n.children)})
            elif isinstance(n, Import):
                entry: dict = {"module": n.name}
                if n.args:
                    entry["args"] = dict(n.args)
                if n.children:
                    entry["parts"] = parts(n.children)
                out.append(entry)
        return out

    return {"schema": prompt.schema, "parts": parts(prompt.parts)}
