"""The package's layers: every import points down (or stays in its layer), and no modules import each
other in a circle. Every ``import`` and ``from ... import`` counts, inside functions and
``if TYPE_CHECKING:`` blocks too: a lazy import is still a dependency.

A new top-level module or package goes into ``LAYERS`` below (a module that no entry covers fails).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import radixrelay

PACKAGE = Path(radixrelay.__file__).parent

# Top to bottom. An entry covers a module and everything under it; the longest entry wins
# (``radixrelay.structured.spec`` is a public leaf of the base, the rest of ``structured`` is not).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("frontends", ("radixrelay", "radixrelay.server", "radixrelay.lang", "radixrelay.engine", "radixrelay.cli",
                   "radixrelay.bench", "radixrelay.router", "radixrelay.admission")),
    ("runtime", ("radixrelay.runtime",)),
    ("scheduler and worker", ("radixrelay.scheduler", "radixrelay.worker")),
    ("components", ("radixrelay.cascade", "radixrelay.modules", "radixrelay.structured")),
    ("model", ("radixrelay.model",)),
    ("attention", ("radixrelay.attention",)),
    ("kernels", ("radixrelay.kernels",)),
    ("base", ("radixrelay.protocol", "radixrelay.text", "radixrelay.gguf_file", "radixrelay.radix", "radixrelay.config", "radixrelay.env", "radixrelay.kv_events",
              "radixrelay.kv_schema", "radixrelay.kv_auth", "radixrelay.kv_store", "radixrelay.net",
              "radixrelay.proc", "radixrelay.sampling_params", "radixrelay.outputs", "radixrelay.structured.spec")),
]
APART = [("radixrelay.scheduler", "radixrelay.worker")]
# Packages that import no torch (every process and every CPU test uses them).
TORCH_FREE = ["radixrelay.protocol", "radixrelay.text", "radixrelay.proc", "radixrelay.gguf_file", "radixrelay.router",
              "radixrelay.kv_events", "radixrelay.kv_schema", "radixrelay.kv_auth", "radixrelay.kv_store",
              "radixrelay.net"]


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports (a package's ``__init__`` is the package's name)."""

    def module_of(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(module_of(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                package = package[:len(package) - (node.level - 1)]
                base = ".".join(package + ([node.module] if node.module else []))
            for alias in node.names:      # ``from pkg import submodule`` imports the submodule
                found.add(module_of(f"{base}.{alias.name}") if f"{base}.{alias.name}" in known
                          else module_of(base))
    return {m for m in found if m is not None and m != name}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def layer_of(module: str) -> int:
    best, depth = None, -1
    for index, (_, entries) in enumerate(LAYERS):
        for entry in entries:
            covers = module == entry or (entry != "radixrelay" and module.startswith(entry + "."))
            if covers and len(entry) > depth:
                best, depth = index, len(entry)
    assert best is not None, f"{module} is in no layer: add it to LAYERS in {__file__}"
    return best


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            for target in targets:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(edges[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_every_module_has_a_layer():
    for module in modules():
        layer_of(module)


def test_no_import_points_up():
    upward = [f"{source} ({LAYERS[layer_of(source)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
              for source, targets in graph().items() for target in sorted(targets)
              if layer_of(target) < layer_of(source)]
    assert upward == []


def test_no_import_circles():
    assert cycles(graph()) == []


def test_apart_packages_do_not_import_each_other():
    def inside(module: str, package: str) -> bool:
        return module == package or module.startswith(package + ".")

    crossing = [f"{source} imports {target}" for source, targets in graph().items() for target in sorted(targets)
                for a, b in APART for x, y in ((a, b), (b, a)) if inside(source, x) and inside(target, y)]
    assert crossing == []


def test_the_checker_sees_circles_and_lazy_imports(tmp_path):
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from radixrelay.protocol.step import StepPlan\n"
                      "if False:\n    import radixrelay.text.tokenizer\n")
    known = {"radixrelay.protocol.step": module, "radixrelay.text.tokenizer": module}
    assert imports("radixrelay.x", module, known) == {"radixrelay.protocol.step", "radixrelay.text.tokenizer"}


@pytest.mark.parametrize("package", TORCH_FREE)
def test_torch_free_packages(package):
    names = sorted(m for m in modules() if m == package or m.startswith(package + "."))
    code = ("import importlib, sys\n"
            f"for name in {names!r}:\n    importlib.import_module(name)\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PACKAGE.parent)
