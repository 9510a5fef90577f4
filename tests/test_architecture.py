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

Two more rules are read from the source the same way: no module uses another's private names, and no
module builds an object around its constructor (`__new__` and `__dict__.update`).
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


# --- private names --------------------------------------------------------------------------------
# A name starting with `_` is its module's own business: no module reaches into another's, except
# among an op's own files (ops/attention.py and ops/attention_kernels.py are one op). What a tool needs
# from an op is made public, named and documented, instead: its checked problem (`<op>_problem`), its
# cuDNN graph builder (`<op>_graph_builder`) and the graph's tensor uids (`UID_*`). Read from libnn/
# and benchmarks/ (whose scripts drive libnn as tools do).
BENCHMARKS = ROOT.parent / "benchmarks"


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _same_op(a: str, b: str) -> bool:
    """Two modules of one op: libnn.ops.<op> and libnn.ops.<op>_kernels."""
    def op(module: str) -> str | None:
        package, _, leaf = module.rpartition(".")
        return leaf.removesuffix("_kernels") if package == "libnn.ops" else None
    return op(a) is not None and op(a) == op(b)


def read_private_uses(name: str, source: str, is_package: bool, known: set[str]) -> list[tuple[str, int]]:
    """("libnn.module._name", line) for each private name of another libnn module that module `name`
    imports (`from libnn.ops.conv2d import _check`) or reads as an attribute of a libnn module it holds
    (`cudnn._planned` after `from libnn.backends import cudnn`, or after importlib.import_module)."""
    tree = ast.parse(source)
    package = name if is_package else name.rpartition(".")[0]
    modules: dict[str, str] = {}   # local name -> the libnn module it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if not (module == "libnn" or module.startswith("libnn.")):
                continue
            for a in node.names:
                if f"{module}.{a.name}" in known:
                    modules[a.asname or a.name] = f"{module}.{a.name}"
                if _is_private(a.name):
                    found.append((f"{module}.{a.name}", node.lineno))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.asname and a.name in known:
                    modules[a.asname] = a.name
        elif (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
              and isinstance(node.value.func, ast.Attribute) and node.value.func.attr == "import_module"
              and node.value.args and isinstance(node.value.args[0], ast.Constant)
              and str(node.value.args[0].value) in known):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    modules[target.id] = node.value.args[0].value
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                and _is_private(node.attr)):
            found.append((f"{modules[node.value.id]}.{node.attr}", node.lineno))
    return [(target, line) for target, line in found
            if target.rpartition(".")[0] != name and not _same_op(name, target.rpartition(".")[0])]


def all_private_uses() -> dict[str, list[str]]:
    """"importer -> module._name" -> the lines, over libnn/ and benchmarks/."""
    paths = sorted(ROOT.rglob("*.py"))
    known = {module_name(p) for p in paths}
    sources = [(module_name(p), p) for p in paths]
    sources += [(module_name(p, BENCHMARKS), p) for p in sorted(BENCHMARKS.glob("*.py"))]
    uses: dict[str, list[str]] = {}
    for name, path in sources:
        for target, line in read_private_uses(name, path.read_text(), path.name == "__init__.py", known):
            uses.setdefault(f"{name} -> {target}", []).append(f"{path.relative_to(ROOT.parent)}:{line}")
    return uses


def test_private_use_reader_finds_imports_and_module_attributes_but_not_an_ops_own_files():
    known = {"libnn", "libnn.ops", "libnn.ops.conv2d", "libnn.ops.attention", "libnn.ops.attention_kernels",
             "libnn.backends", "libnn.backends.cudnn"}
    source = ("import importlib\n"
              "from libnn.ops.conv2d import _check, conv2d\n"
              "from libnn.backends import cudnn\n"
              "from libnn.ops.attention_kernels import _tile\n"
              "from libnn.runtime import device as _device\n"
              "def f():\n"
              "    m = importlib.import_module('libnn.ops.conv2d')\n"
              "    return m._graph_builder, cudnn._planned, m.__name__, conv2d._x\n")
    found = read_private_uses("libnn.ops.attention", source, False, known)
    assert sorted(found) == [("libnn.backends.cudnn._planned", 8), ("libnn.ops.conv2d._check", 2),
                             ("libnn.ops.conv2d._graph_builder", 8)]


def test_no_module_uses_another_modules_private_names():
    uses = all_private_uses()
    assert not uses, ("private names of another libnn module (make them public in their module instead):\n"
                      + "\n".join(f"  {use} at {', '.join(lines)}" for use, lines in sorted(uses.items())))


def constructor_bypasses(source: str) -> list[int]:
    """Lines that call `X.__new__(...)` or `obj.__dict__.update(...)`: an object made or refilled without
    its constructor, which skips the checks and the state (version counters, caches) __init__ sets up."""
    return sorted(node.lineno for node in ast.walk(ast.parse(source))
                  if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and (node.func.attr == "__new__" or (node.func.attr == "update"
                                                       and isinstance(node.func.value, ast.Attribute)
                                                       and node.func.value.attr == "__dict__")))


def test_constructor_bypass_reader_finds_both_forms():
    source = "c = Conv2d.__new__(Conv2d)\nc.__dict__.update(other.__dict__)\nd.update(e)\nf = object()\n"
    assert constructor_bypasses(source) == [1, 2]


def test_no_module_clones_around_the_constructor():
    found = {str(path.relative_to(ROOT.parent)): lines for path in sorted(ROOT.rglob("*.py"))
             if (lines := constructor_bypasses(path.read_text()))}
    assert not found, f"objects built without their constructor (build them through it instead): {found}"
