"""The import graph of fastarch: no cycles, and no layer imports a layer above it.

Every module is parsed, not imported, and every ``import`` statement counts, including those inside
functions: a function-local import hides a cycle from the interpreter but not from the reader.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Where each package's sources live in a checkout.
PACKAGE_ROOTS = {"fastarch": ROOT / "fastarch"}

# Bottom to top. A module may import its own layer and the layers below it. A name matches a module and
# every module under it; the longest match wins.
LAYERS: list[tuple[str, ...]] = [
    ("fastarch.kernels",),
    ("fastarch._files", "fastarch.backend", "fastarch.extensions"),
    ("fastarch.ops",),
    ("fastarch.nn",),
    ("fastarch.models",),
    ("fastarch.generation", "fastarch.tokenizers", "fastarch.optim", "fastarch.train", "fastarch.distributed"),
    ("fastarch.integrations", "fastarch.compat"),
    ("fastarch.bench", "fastarch.cli", "fastarch.info", "fastarch.__main__", "fastarch"),
]


def module_files() -> dict[str, Path]:
    """Every fastarch module name and its source file."""
    out: dict[str, Path] = {}
    for pkg, folder in PACKAGE_ROOTS.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([pkg, *parts])] = path
    return out


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> Iterator[tuple[str, str | None]]:
    """(module, attribute) pairs for every import in ``tree``; attribute is the name taken with ``from``."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                yield target, alias.name
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            yield node.args[0].value, None


def import_graph() -> dict[str, set[str]]:
    """module -> the fastarch modules it imports (a package's ``__init__`` is the package's name)."""
    files = module_files()
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        deps: set[str] = set()
        for target, attr in _imported_names(tree, module, path.name == "__init__.py"):
            if attr is not None and f"{target}.{attr}" in files:
                deps.add(f"{target}.{attr}")
            elif target in files:
                deps.add(target)
        deps.discard(module)
        graph[module] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def layer_of(module: str) -> int:
    best, best_len = -1, -1
    for i, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best_len:
                best, best_len = i, len(name)
    return best


def test_every_module_has_a_layer() -> None:
    unplaced = [m for m in import_graph() if layer_of(m) < 0]
    assert not unplaced, f"modules in no layer (add them to LAYERS): {unplaced}"


def test_graph_sees_function_local_imports() -> None:
    tree = ast.parse("def f():\n    from ..ops import attention\n    import fastarch.backend\n")
    got = set(_imported_names(tree, "fastarch.nn.x", is_package=False))
    assert got == {("fastarch.ops", "attention"), ("fastarch.backend", None)}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles between fastarch modules:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_layer_imports_a_layer_above_it() -> None:
    bad = []
    for module, deps in import_graph().items():
        for dep in sorted(deps):
            if layer_of(dep) > layer_of(module):
                bad.append(f"{module} (layer {layer_of(module)}) imports {dep} (layer {layer_of(dep)})")
    assert not bad, "imports of a higher layer:\n" + "\n".join(bad)
