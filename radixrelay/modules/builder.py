"""Build PML schemas in Python (paper section 3.2.4): the same AST the parser makes.

    from radixrelay.modules.builder import schema, module, param, union, scaffold, system
    s = schema("cities",
               system("You are a travel guide."),
               module("trip-plan", "Plan a trip of ", param("duration", 2), " days."),
               union(module("tokyo", "Tokyo is ..."), module("miami", "Miami is ...")),
               scaffolds=[scaffold("both", "trip-plan", "miami")])

Strings become Text and children are put in normal form (``pml.merge_text``: blank text dropped,
adjacent text merged). Only ``schema()`` validates, with ``pml.validate``, the very function
``parse_schema`` uses, so both ways in accept and reject exactly the same trees with the same
messages, and ``parse_schema(to_pml(s)) == s``. The inner builders only assemble nodes.
"""

from __future__ import annotations

from collections.abc import Iterable

from .pml import Limits, Module, Node, Param, Role, Scaffold, Schema, Text, Union, merge_text, validate

Child = Node | str


def schema(name: str, *children: Child, scaffolds: Iterable[Scaffold] = (), limits: Limits | None = None) -> Schema:
    """A validated schema (SchemaError if invalid)."""
    built = Schema(name, merge_text(children), tuple(scaffolds))
    validate(built, limits)
    return built


def module(name: str, *children: Child) -> Module:
    """A prompt module; may hold text, params, roles, nested modules and unions."""
    return Module(name, merge_text(children))


def param(name: str, length: int) -> Param:
    """A placeholder of ``length`` tokens (valid only inside a module)."""
    return Param(name, length)


def union(*modules: Module) -> Union:
    """Mutually exclusive modules sharing one start position."""
    return Union(tuple(modules))


def scaffold(name: str, *module_names: str) -> Scaffold:
    """Modules (at least two) also encoded together in one attention span."""
    return Scaffold(name, tuple(module_names))


def system(*children: Child) -> Role:
    return Role("system", merge_text(children))


def user(*children: Child) -> Role:
    return Role("user", merge_text(children))


def assistant(*children: Child) -> Role:
    return Role("assistant", merge_text(children))


def text(value: str) -> Text:
    """Explicit text node (plain strings work too)."""
    return Text(value)
