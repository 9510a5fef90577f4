"""libnn's imports keep its layers: no import cycle, and no module imports a layer above its own.

The imports are read from the source with `ast` (no module is imported), at module level and inside
functions alike: an import moved into a function still ties its module to the one it names, it only
hides the tie until the function runs. Only imports of libnn's own modules are checked; third-party
packages (cupy, cudnn, nvmath, torch, transformers, cuda.bindings) are the modules' own business and
optional ones are imported inside functions on purpose.

Each edge goes to the module an import names: `from libnn.nn import weights` to libnn.nn.weights,
`from libnn.nn import Module` to the package libnn.nn. The parent packages Python imports first
(`import libnn.nn.module` runs libnn/__init__.py and libnn/nn/__init__.py) are not edges: a package's
__init__ is a module of its own layer like any other, checked by its own imports.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "libnn"

# Bottom to top. A module may import its own layer and the layers below, never one above. A name is
# a module or a package (every module below it); the longest name that matches a module gives its layer.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # What every layer may use: the exception types, dtype names, and the user's settings.
    ("foundations", ("libnn.errors", "libnn.dtypes", "libnn.config")),
    # Devices, streams, arrays, memory checks, plan caches and their disk directory, NVRTC and the
    # kernel loader, launches, GPU timing: everything about running on the GPU that knows no op.
    ("runtime", ("libnn.runtime",)),
    # The op front end (paths, dispatch, bound calls) and one module per vendor library (cuBLASLt,
    # cuDNN graphs) that builds, caches and runs its plans; they serve the ops and know none of them.
    ("registry and backends", ("libnn.registry", "libnn.backends")),
    # One module per op: its signature, checks and paths, registered by name.
    ("ops", ("libnn.ops",)),
    # Layers in the PyTorch style, calling ops.
    ("nn", ("libnn.nn",)),
    # Models built from layers, with their checkpoints (and `libnn run cnn`'s body).
    ("models", ("libnn.models",)),
    # Tools on top: benchmarks, inspection, the CLI and demo, and libnn/__init__.py, the public
    # surface that re-exports from every layer (so no module below may import names from `libnn`).
    ("tools", ("libnn.bench", "libnn.inspect", "libnn.cli", "libnn.demo", "libnn.__main__", "libnn")),
]


@dataclass(frozen=True)
class Import:
    source: str   # the importing module
    target: str   # the libnn module or package it names
    line: int
    local: bool   # inside a function


def module_name(path: Path, root: Path | None = None) -> str:
    root = root or ROOT
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def read_imports(name: str, source: str, is_package: bool, known: set[str]) -> list[Import]:
    """The libnn imports of module `name`, whose text is `source`; `known` is every libnn module, to
    tell `from package import module` from `from module import name`."""
    tree = ast.parse(source)
    package = name if is_package else name.rpartition(".")[0]
    found = []

    def visit(node: ast.AST, local: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                if child.level:  # relative: `from . import x`, `from ..runtime import y`
                    base = package.split(".")[:len(package.split(".")) - (child.level - 1)]
                    module = ".".join(base + ([child.module] if child.module else []))
                else:
                    module = child.module or ""
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in child.names]
            else:
                visit(child, inner)
                continue
            for target in dict.fromkeys(targets):
                if target == "libnn" or target.startswith("libnn."):
                    found.append(Import(name, target, child.lineno, local))

    visit(tree, False)
    return found


def all_imports(root: Path | None = None) -> list[Import]:
    root = root or ROOT
    paths = sorted(root.rglob("*.py"))
    known = {module_name(p, root) for p in paths}
    return [i for p in paths for i in read_imports(module_name(p, root), p.read_text(), p.name == "__init__.py", known)]


def layer_of(module: str) -> int | None:
    """The index in LAYERS of `module`'s layer: the longest name that is the module or a package
    above it. The root package `libnn` names its __init__ only, so that a new module left out of the
    table is reported rather than taken for a tool."""
    best, best_len = None, -1
    for index, (_, names) in enumerate(LAYERS):
        for n in names:
            matches = module == n or (n != "libnn" and module.startswith(n + "."))
            if matches and len(n) > best_len:
                best, best_len = index, len(n)
    return best


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_import_reader_resolves_relative_from_and_function_local_imports():
    known = {"libnn", "libnn.nn", "libnn.nn.module", "libnn.nn.weights", "libnn.registry"}
    source = ("from libnn.nn import weights, Module\n"
              "from . import module\n"
              "import cupy\n"
              "def load():\n"
              "    from ..registry import get_op\n"
              "    import libnn\n")
    found = read_imports("libnn.nn.graphs", source, False, known)
    assert [(i.target, i.line, i.local) for i in found] == [
        ("libnn.nn.weights", 1, False), ("libnn.nn", 1, False), ("libnn.nn.module", 2, False),
        ("libnn.registry", 5, True), ("libnn", 6, True)]


def test_layer_table_places_every_libnn_module():
    unplaced = sorted({m for i in all_imports() for m in (i.source, i.target)} |
                      {module_name(p) for p in ROOT.rglob("*.py")})
    unplaced = [m for m in unplaced if layer_of(m) is None]
    assert not unplaced, f"modules in no layer of tests/test_architecture.py's LAYERS: {unplaced}"


def test_no_libnn_module_imports_a_higher_layer():
    breaches = []
    for i in all_imports():
        source, target = layer_of(i.source), layer_of(i.target)
        if source is not None and target is not None and target > source:
            breaches.append(f"{i.source}:{i.line} ({LAYERS[source][0]}) imports {i.target} ({LAYERS[target][0]})"
                            + (" inside a function" if i.local else ""))
    assert not breaches, "imports of a higher layer:\n" + "\n".join(breaches)


@pytest.mark.parametrize("which", ["module-level", "all"])
def test_libnn_imports_form_no_cycle(which):
    """No cycle among module-level imports (Python would meet a half-initialised module), nor among
    all imports: a cycle closed by an import inside a function is the same tangle, hidden."""
    imports = [i for i in all_imports() if which == "all" or not i.local]
    edges: dict[str, set[str]] = {}
    where: dict[tuple[str, str], list[str]] = {}
    for i in imports:
        if i.source != i.target:
            edges.setdefault(i.source, set()).add(i.target)
            where.setdefault((i.source, i.target), []).append(f"{i.line}{' (in a function)' if i.local else ''}")
    found = cycles(edges)
    described = []
    for component in found:
        members = set(component)
        links = [f"  {a} -> {b} at line {', '.join(where[(a, b)])}"
                 for a in component for b in sorted(edges.get(a, ())) if b in members]
        described.append("cycle among " + ", ".join(component) + ":\n" + "\n".join(links))
    assert not found, "\n".join(described)
