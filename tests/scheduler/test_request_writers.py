"""One writer per side record of a scheduler ``Request`` (as ``test_kv_owner`` is for ``KVHold``): the walk
hint by ``match_hint``, the queue policy's cached match by ``policy``, the host tier's hint and fetch flag by
the tier coordinator, the KV events' count by ``kv_events``, the content keys of its pages (and of a truncated
prompt's previous sequence) by ``content_keys``, the early-load flag by the cache manager.
A write is an assignment, augmented assignment or mutating call whose target is ``<x>.<field>`` (or an
item of it) anywhere in the package; ``self.<field>`` is another object's own field."""

from __future__ import annotations

import ast
from pathlib import Path

import radixrelay

PACKAGE = Path(radixrelay.__file__).parent
WRITERS = {
    "tree_hint": {"scheduler/match_hint.py"},
    "lpm_match": {"scheduler/policy.py"},
    "host_hint": {"scheduler/tier_coordinator.py"},
    "skipped_fetch": {"scheduler/tier_coordinator.py"},
    "events_told": {"scheduler/kv_event_hook.py"},
    "prefix_keys": {"scheduler/content_keys.py"},
    "shifted_keys": {"scheduler/content_keys.py"},
    "early_load_tried": {"scheduler/cache.py"},
}
MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse"}


def _written(tree: ast.AST) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            targets = [node.func.value]
        else:
            continue
        while targets:
            target = targets.pop()
            if isinstance(target, ast.Tuple):
                targets.extend(target.elts)
                continue
            while isinstance(target, ast.Subscript):
                target = target.value
            if (isinstance(target, ast.Attribute) and target.attr in WRITERS
                    and not (isinstance(target.value, ast.Name) and target.value.id == "self")):
                found.add(target.attr)
    return found


def test_each_side_record_has_its_writer():
    seen: dict[str, set[str]] = {field: set() for field in WRITERS}
    for path in PACKAGE.rglob("*.py"):
        for field in _written(ast.parse(path.read_text())):
            seen[field].add(str(path.relative_to(PACKAGE)))
    assert {f: w for f, w in seen.items() if not w <= WRITERS[f]} == {}
    assert all(seen[f] for f in WRITERS)        # each is written somewhere (the scan sees the writes)
