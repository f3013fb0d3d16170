"""Position-ID layout of a PML schema (Prompt Cache paper section 3.3) and of prompts against it (3.4).

Pure: tokenisation is the caller's ``encode`` callback; no torch.

Schema layout. Walk the schema in document order with a position counter starting at 0:
    * A module's own tokens (its text, its params' placeholders, role markers inside it) take
      consecutive positions. A nested module or union is laid out where it appears, after the
      parent tokens before it; the parent's later tokens continue after the nested span. So a
      module's positions may have gaps (where its children sit); ``start``/``end`` bound its span,
      nested children included.
    * A param is ``length`` copies of ``placeholder_id``; ``params[name] = (offset, length)`` with
      the offset into the module's ``token_ids``.
    * Text and roles outside any module form anonymous, always-imported segments "#0", "#1", ... in
      document order (a segment ends where a module or union starts; empty segments are skipped).
    * Roles: ``role_text(role) -> (begin, end)`` strings around the role's content (e.g. ChatML
      "<|im_start|>user\\n", "<|im_end|>\\n"); None: roles add no tokens.
    * Each text piece (text node, marker) is encoded separately, so no token crosses a module,
      param or marker edge; consecutive pieces concatenate.
    * Union: every member starts at the union's start; the union advances the counter by its
      longest member's span (own tokens + nested children).

Prompt plan (``SchemaLayout.prompt_plan``), the segments a prompt is made of, in order:
    * ``ModuleSegment(name)`` per imported module, followed by ``ParamSegment``s for the values it
      was given, in the order written, then its nested imports/text. A value's tokens take the
      placeholder's first positions; more tokens than ``len`` is a SchemaError.
    * Anonymous segments are always at their schema positions and are emitted eagerly: at the start
      of the plan and right after each top-level import, every anonymous segment not yet emitted
      that precedes (in document order) the next top-level import of the prompt; all those left
      when no import follows. So a schema's leading text comes before any new text, and its
      trailing text comes right after the last import, before trailing new text.
    * New text (and role markers of the prompt's own roles) gets consecutive positions starting at
      the *frontier*: one past the highest position of anything placed before it in the plan (0 if
      nothing). Modules move the frontier to one past their highest own position; a param value
      does not move it (it sits inside its module). New text may therefore share positions with a
      module that comes after it, as in the paper ("text between A and B starts at A's end").
    * Segments with no tokens (an empty value, text that encodes to nothing) are left out.
    * ``end`` is the final frontier: where generation continues. ``scaffolds`` lists the schema's
      scaffolds whose modules are all imported.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from .pml import (
    DEFAULT_LIMITS,
    ROLES,
    Import,
    Limits,
    Module,
    ModuleInfo,
    Param,
    Prompt,
    Role,
    Schema,
    SchemaError,
    Text,
    Union,
    check_imports,
    module_index,
    validate_prompt,
)

Encode = Callable[[str], Sequence[int]]
RoleText = Callable[[str], tuple[str, str]]


@dataclass(frozen=True)
class ModuleLayout:
    """Tokens and position IDs of one module (or anonymous segment).

    ``token_ids[i]`` sits at ``positions[i]``; ``params[name] = (offset, length)`` indexes
    ``token_ids``. ``[start, end)`` is the module's span including nested children; ``union`` is the
    union's index in document order (members share it); anonymous segments have parent/union None."""

    name: str
    token_ids: tuple[int, ...]
    positions: tuple[int, ...]
    params: dict[str, tuple[int, int]] = field(hash=False)
    parent: str | None
    union: int | None
    anonymous: bool
    start: int
    end: int


@dataclass(frozen=True)
class SchemaLayout:
    """Layout of a whole schema: ``modules`` in document order (anonymous ones named "#k"), ``end``
    the first position after the schema, ``role_markers`` the (begin, end) text per role (empty when
    laid out without ``role_text``). ``index`` and ``limits`` let prompt_plan check prompts without
    re-validating the schema."""

    schema: Schema
    modules: dict[str, ModuleLayout] = field(hash=False)
    end: int
    scaffolds: dict[str, tuple[str, ...]] = field(hash=False)
    role_markers: dict[str, tuple[str, str]] = field(hash=False)
    index: dict[str, ModuleInfo] = field(hash=False, repr=False)
    limits: Limits = DEFAULT_LIMITS

    @property
    def schema_name(self) -> str:
        return self.schema.name

    def prompt_plan(self, prompt: Prompt, encode: Encode) -> PromptPlan:
        """The segments of ``prompt`` (checked against the schema) with their positions; rules in
        the module docstring."""
        validate_prompt(prompt, self.limits)
        check_imports(prompt, self.schema.name, self.index)
        return _Planner(self, encode).run(prompt)


@dataclass(frozen=True)
class ModuleSegment:
    """A cached module (or anonymous segment) reused as laid out."""

    name: str


@dataclass(frozen=True)
class ParamSegment:
    """A param value: ``token_ids`` at ``positions`` replace the placeholder's first tokens."""

    module: str
    name: str
    token_ids: tuple[int, ...]
    positions: tuple[int, ...]


@dataclass(frozen=True)
class TextSegment:
    """New (uncached) text of the prompt."""

    token_ids: tuple[int, ...]
    positions: tuple[int, ...]


Segment = ModuleSegment | ParamSegment | TextSegment


@dataclass(frozen=True)
class PromptPlan:
    """What a prompt is made of, in order; ``end``: the position after everything placed."""

    schema_name: str
    segments: tuple[Segment, ...]
    end: int
    scaffolds: tuple[str, ...]


def _ids(encode: Encode, text: str) -> list[int]:
    return list(encode(text)) if text else []


class _Layouter:
    """Walks a validated schema once; ``pos`` is the next free position."""

    def __init__(self, encode: Encode, placeholder_id: int, markers: dict[str, tuple[str, str]]) -> None:
        self.encode = encode
        self.placeholder_id = placeholder_id
        self.markers = markers
        self.pos = 0
        self.unions = 0
        self.anon_count = 0
        self.modules: dict[str, ModuleLayout | None] = {}
        self.anon_ids: list[int] = []
        self.anon_pos: list[int] = []

    # Outside modules: tokens accumulate into the current anonymous segment.
    def top(self, children: Sequence[object]) -> None:
        for child in children:
            if isinstance(child, Text):
                self.anon(_ids(self.encode, child.text))
            elif isinstance(child, Role):
                begin, end = self.markers.get(child.role, ("", ""))
                self.anon(_ids(self.encode, begin))
                self.top(child.children)
                self.anon(_ids(self.encode, end))
            elif isinstance(child, Module):
                self.flush()
                self.module(child, None, None)
            elif isinstance(child, Union):
                self.flush()
                self.union(child, None)

    def anon(self, ids: list[int]) -> None:
        self.anon_ids += ids
        self.anon_pos += range(self.pos, self.pos + len(ids))
        self.pos += len(ids)

    def flush(self) -> None:
        if not self.anon_ids:
            return
        name = f"#{self.anon_count}"
        self.anon_count += 1
        self.modules[name] = ModuleLayout(name, tuple(self.anon_ids), tuple(self.anon_pos), {}, None, None, True,
                                          self.anon_pos[0], self.anon_pos[-1] + 1)
        self.anon_ids, self.anon_pos = [], []

    def module(self, m: Module, parent: str | None, union: int | None) -> None:
        start = self.pos
        self.modules[m.name] = None  # reserve the document-order slot before nested modules
        ids: list[int] = []
        pos: list[int] = []
        params: dict[str, tuple[int, int]] = {}
        self.body(m.children, m.name, ids, pos, params)
        self.modules[m.name] = ModuleLayout(m.name, tuple(ids), tuple(pos), params, parent, union, False,
                                            start, self.pos)

    def body(self, children: Sequence[object], name: str, ids: list[int], pos: list[int],
             params: dict[str, tuple[int, int]]) -> None:
        def put(new: list[int]) -> None:
            ids.extend(new)
            pos.extend(range(self.pos, self.pos + len(new)))
            self.pos += len(new)

        for child in children:
            if isinstance(child, Text):
                put(_ids(self.encode, child.text))
            elif isinstance(child, Param):
                params[child.name] = (len(ids), child.length)
                put([self.placeholder_id] * child.length)
            elif isinstance(child, Role):
                begin, end = self.markers.get(child.role, ("", ""))
                put(_ids(self.encode, begin))
                self.body(child.children, name, ids, pos, params)
                put(_ids(self.encode, end))
            elif isinstance(child, Module):
                self.module(child, name, None)
            elif isinstance(child, Union):
                self.union(child, name)

    def union(self, u: Union, parent: str | None) -> None:
        uid = self.unions
        self.unions += 1
        start = end = self.pos
        for member in u.members:
            self.pos = start
            self.module(member, parent, uid)
            end = max(end, self.pos)
        self.pos = end


def layout(schema: Schema, encode: Encode, *, placeholder_id: int, role_text: RoleText | None = None,
           limits: Limits | None = None) -> SchemaLayout:
    """Lay out ``schema`` (validated first, under ``limits``); rules in the module docstring."""
    limits = limits or DEFAULT_LIMITS
    index = module_index(schema, limits)
    if isinstance(placeholder_id, bool) or not isinstance(placeholder_id, int):
        raise TypeError(f"placeholder_id must be an int, got {type(placeholder_id).__name__}")
    markers = {role: tuple(role_text(role)) for role in ROLES} if role_text is not None else {}
    w = _Layouter(encode, placeholder_id, markers)  # type: ignore[arg-type]
    w.top(schema.children)
    w.flush()
    modules = {name: m for name, m in w.modules.items() if m is not None}
    return SchemaLayout(schema, modules, w.pos, {s.name: s.modules for s in schema.scaffolds},
                        markers, index, limits)  # type: ignore[arg-type]


class _Planner:
    def __init__(self, lay: SchemaLayout, encode: Encode) -> None:
        self.lay = lay
        self.encode = encode
        self.segments: list[Segment] = []
        self.frontier = 0  # one past the highest position placed so far
        self.order = {name: i for i, name in enumerate(lay.modules)}
        self.anon = [m.name for m in lay.modules.values() if m.anonymous]  # document order
        self.next_anon = 0
        self.placed: set[str] = set()  # modules and anonymous segments placed so far
        self.tops_after: Iterator[str | None] = iter(())  # the next top-level import, after each one

    def run(self, prompt: Prompt) -> PromptPlan:
        tops = [p.name for p in _top_imports(prompt.parts)]
        self.tops_after = iter(tops[1:] + [None])
        self.emit_anon_before(tops[0] if tops else None)
        self.parts(prompt.parts, top=True)
        active = tuple(name for name, mods in self.lay.scaffolds.items() if self.placed.issuperset(mods))
        return PromptPlan(self.lay.schema_name, tuple(self.segments), self.frontier, active)

    def emit_anon_before(self, name: str | None) -> None:
        limit = self.order[name] if name is not None else len(self.order)
        while self.next_anon < len(self.anon) and self.order[self.anon[self.next_anon]] < limit:
            self.place_module(self.anon[self.next_anon])
            self.next_anon += 1

    def place_module(self, name: str) -> None:
        self.segments.append(ModuleSegment(name))
        self.placed.add(name)
        positions = self.lay.modules[name].positions
        if positions:
            self.frontier = max(self.frontier, max(positions) + 1)

    def text(self, text: str) -> None:
        ids = tuple(_ids(self.encode, text))
        if ids:
            self.segments.append(TextSegment(ids, tuple(range(self.frontier, self.frontier + len(ids)))))
            self.frontier += len(ids)

    def parts(self, parts: Sequence[object], top: bool) -> None:
        for part in parts:
            if isinstance(part, Text):
                self.text(part.text)
            elif isinstance(part, Role):
                begin, end = self.lay.role_markers.get(part.role, ("", ""))
                self.text(begin)
                self.parts(part.children, top)
                self.text(end)
            elif isinstance(part, Import):
                self.import_(part)
                if top:
                    self.emit_anon_before(next(self.tops_after))

    def import_(self, imp: Import) -> None:
        self.place_module(imp.name)
        m = self.lay.modules[imp.name]
        for key, value in imp.args:
            offset, length = m.params[key]
            ids = tuple(_ids(self.encode, value))
            if len(ids) > length:
                raise SchemaError(f"parameter {key} of module {imp.name} takes at most {length} tokens, "
                                  f"got {len(ids)}")
            if ids:
                self.segments.append(ParamSegment(imp.name, key, ids, m.positions[offset:offset + len(ids)]))
        self.parts(imp.children, top=False)


def _top_imports(parts: Sequence[object]) -> list[Import]:
    """Imports at the top level of a prompt (directly or inside its roles), in order."""
    out: list[Import] = []
    for part in parts:
        if isinstance(part, Import):
            out.append(part)
        elif isinstance(part, Role):
            out.extend(_top_imports(part.children))
    return out
