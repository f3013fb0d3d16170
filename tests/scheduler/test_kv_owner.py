"""One owner of a request's KV hold: only the cache manager (``radixrelay/scheduler/cache.py``) writes
``Request.hold`` or a field of ``KVHold``; the scheduler, its managers and everyone else read them and
ask the cache manager for changes.

A write is an assignment, augmented assignment or ``del`` whose target is such an attribute (or an
item or slice of one), a mutating call on one (``hold.pages.append(...)``), or ``setattr`` with one's
name. The scan covers every module of the package:
- ``<x>.hold = ...`` and ``<x>.hold.<field>`` anywhere, or ``<name>.<field>`` where ``<name>`` was
  bound to ``<x>.hold`` in the module;
- a bare ``<x>.<field>`` (a hold reached some other way) in the modules that can reach ``Request``:
  the scheduler package and every module importing it. ``pages`` is left out of this rule: radix
  nodes, worker rows and plans have pages of their own.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import radixrelay
from radixrelay.scheduler.request import KVHold, Request

PACKAGE = Path(radixrelay.__file__).parent
OWNER = PACKAGE / "scheduler" / "cache.py"
FIELDS = {f.name for f in dataclasses.fields(KVHold)}
DISTINCT = FIELDS - {"pages"}            # names no other object of the scheduler's world uses
MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse",
            "__setitem__", "__delitem__", "__iadd__"}


def _aliases(tree: ast.AST) -> set[str]:
    """Names bound to a hold: ``hold = req.hold``, ``ps, hold = self.page_size, req.hold``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                pairs = (zip(target.elts, node.value.elts)
                         if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple)
                         else [(target, node.value)])
                names.update(t.id for t, v in pairs if isinstance(t, ast.Name) and _is_hold(v, set()))
    return names


def _is_hold(node: ast.expr, aliases: set[str]) -> bool:
    return ((isinstance(node, ast.Attribute) and node.attr == "hold")
            or (isinstance(node, ast.Name) and node.id in aliases))


def _hold_attribute(node: ast.expr, aliases: set[str], bare: bool) -> bool:
    """``<x>.hold``, ``<x>.hold.<field>`` (or through an alias), or (``bare``) ``<x>.<distinct field>``."""
    if not isinstance(node, ast.Attribute):
        return False
    return (node.attr == "hold" or (node.attr in FIELDS and _is_hold(node.value, aliases))
            or (bare and node.attr in DISTINCT))


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        found = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        found = [node.target]
    elif isinstance(node, ast.Delete):
        found = list(node.targets)
    else:
        return []
    flat = []
    while found:
        target = found.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            found.extend(target.elts)
        elif isinstance(target, ast.Starred):
            found.append(target.value)
        elif isinstance(target, ast.Subscript):
            found.append(target.value)                   # hold.pages[i] = ... writes the hold's list
        else:
            flat.append(target)
    return flat


def writes(source: str, bare: bool) -> list[tuple[int, str]]:
    """(line, text) of every write to the hold in ``source``; ``bare``: bare distinct field names count too."""
    found = []
    tree = ast.parse(source)
    aliases = _aliases(tree)
    for node in ast.walk(tree):
        for target in _targets(node):
            if _hold_attribute(target, aliases, bare):
                found.append((node.lineno, ast.unparse(target)))
        if isinstance(node, ast.Call):
            func = node.func
            if (isinstance(func, ast.Attribute) and func.attr in MUTATORS
                    and _hold_attribute(func.value, aliases, bare)):
                found.append((node.lineno, ast.unparse(func)))
            if (isinstance(func, ast.Name) and func.id in ("setattr", "delattr") and len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant) and node.args[1].value in FIELDS | {"hold"}):
                found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def _reaches_request(path: Path, source: str) -> bool:
    return path.parent == PACKAGE / "scheduler" or "radixrelay.scheduler" in source


def test_only_the_cache_manager_writes_the_kv_hold():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == OWNER:
            continue
        source = path.read_text()
        found += [f"{path.relative_to(PACKAGE.parent)}:{line}: {text}"
                  for line, text in writes(source, _reaches_request(path, source))]
    assert found == []


def test_the_owner_writes_it():
    """The scan sees the owner's own writes (it would not pass on an empty rule)."""
    assert {text.rsplit(".", 1)[-1] for _, text in writes(OWNER.read_text(), True)} >= DISTINCT | {"pages"}


def test_request_carries_no_kv_fields_of_its_own():
    names = {f.name for f in dataclasses.fields(Request)}
    assert names & (FIELDS | {"path_key", "path"}) == set()
    assert {"rid", "token_ids", "sampling", "salt", "arrival", "phase", "hold", "num_pending"} <= names


def test_the_scan_sees_every_kind_of_write():
    source = "\n".join([
        "req.hold.kv_len += 1",
        "req.hold.pages, req.hold.num_shared_pages = [], 0",
        "req.hold.pages.append(3)",
        "r.hold.pages[0] = 1",
        "del r.hold.pages[1:]",
        "req.hold = None",
        "hold.module_nodes.extend(nodes)",
        "h.kv_committed = 4",
        "setattr(req.hold, 'lock_node', None)",
        "x = req.hold.kv_len + len(req.hold.pages)",         # reads: not writes
        "node.pages.append(1)",                               # a radix node's pages: not the hold's
        "f(req.hold.pages.pop)",                              # a read (not a call) of a mutator
        "ps, mine = 16, req.hold",
        "mine.pages.extend([1, 2])",                          # through an alias
        "mine.pages = []",
    ])
    assert [line for line, _ in writes(source, bare=True)] == [1, 2, 2, 3, 4, 5, 6, 7, 8, 9, 14, 15]
    assert [line for line, _ in writes(source, bare=False)] == [1, 2, 2, 3, 4, 5, 6, 9, 14, 15]
