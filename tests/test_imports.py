"""The import graph of ``src/kalos`` has no cycles between modules.

Every module's imports are read with :mod:`ast`: absolute and relative, at module level and
inside functions (lazy imports count: a cycle through a function-level import is still a cycle
a reader has to hold in their head). Two graphs are held:

- the imports that run (module level and lazy, ``if TYPE_CHECKING:`` left out): no cycle, no
  exception;
- the same plus the ``if TYPE_CHECKING:`` imports (a type named from a higher layer is still a
  dependency on it): no cycle but the few listed in :data:`TYPE_ONLY_EXCEPTIONS`.

An edge ``a -> b`` means module ``a`` imports module ``b`` (or a name from it). Importing a
package ``kalos.x`` counts as an edge to ``kalos/x/__init__.py``; ``from kalos.x import y``
counts as an edge to ``kalos.x.y`` when that is a module, otherwise to ``kalos.x``. The
packages a module sits in are not edges: Python runs every parent ``__init__`` first, for
every module alike.
"""

from __future__ import annotations

import ast
from collections.abc import Collection
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "kalos"

# Type-only edges left out of the second graph, each with its reason; keep this list short.
TYPE_ONLY_EXCEPTIONS: set[tuple[str, str]] = {
    # The doorbell names the GPU search's PinnedArena and result graph in annotations, and the
    # GPU search starts the doorbell (a lazy import). Both belong to the GPU path that is
    # becoming an index backend; the pair goes when that backend owns both.
    ("kalos.server.doorbell", "kalos.server.gpu_search"),
}


def module_name(path: Path, src: Path = SRC) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_type_checking(test: ast.expr) -> bool:
    """``if TYPE_CHECKING:`` or ``if typing.TYPE_CHECKING:``."""
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def imported_names(
    tree: ast.AST, module: str, is_package: bool, modules: set[str], type_only: bool = False
) -> set[str]:
    """Every dotted name this module imports, relative imports resolved; the imports under
    ``if TYPE_CHECKING:`` only when ``type_only``."""
    found: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and is_type_checking(node.test) and not type_only:
            for child in node.orelse:  # the else branch does run
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                if node.level > 1:
                    base_parts = base_parts[: -(node.level - 1)]
                base = ".".join(base_parts)
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            for alias in node.names:
                # `from pkg import submodule` names the submodule; `from mod import name`, mod
                found.add(
                    f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules else target
                )
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def package_files(src: Path = SRC, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> its source file, for every Python module of ``package``."""
    return {module_name(p, src): p for p in sorted((src / package).rglob("*.py"))}


def imports_of(name: str, path: Path, modules: set[str], type_only: bool = False) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return imported_names(tree, name, path.name == "__init__.py", modules, type_only)


def import_graph(
    src: Path = SRC,
    package: str = PACKAGE,
    type_only: bool = False,
    exceptions: Collection[tuple[str, str]] = (),
) -> dict[str, set[str]]:
    """module -> the modules of ``package`` it imports (itself and ``exceptions`` left out)."""
    files = package_files(src, package)
    # compiled modules (kalos._native) are modules too, named by their stub
    modules = set(files) | {module_name(p, src) for p in (src / package).rglob("*.pyi")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        targets = imports_of(name, path, modules, type_only) & set(files)
        graph[name] = {t for t in targets - {name} if (name, t) not in exceptions}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = 0

    def strongconnect(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strongconnect(w)
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
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return sorted(cycles)


def describe(cycle: list[str], graph: dict[str, set[str]]) -> str:
    members = set(cycle)
    edges = [f"  {a} -> {b}" for a in cycle for b in sorted(graph[a] & members)]
    return "\n".join([" <-> ".join(cycle), *edges])


def assert_acyclic(graph: dict[str, set[str]]) -> None:
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(describe(c, graph) for c in cycles)


def test_the_imports_that_run_have_no_cycles() -> None:
    assert_acyclic(import_graph())


def test_with_type_only_imports_no_cycles_but_the_listed_ones() -> None:
    assert_acyclic(import_graph(type_only=True, exceptions=TYPE_ONLY_EXCEPTIONS))


def test_type_only_exceptions_are_still_type_only_edges() -> None:
    # an exception the code no longer has goes from the list; one that runs is no exception
    files = package_files()
    for a, b in TYPE_ONLY_EXCEPTIONS:
        assert a in files and b in files, (a, b)
        assert b in imports_of(a, files[a], set(files), type_only=True), (a, b)
        assert b not in imports_of(a, files[a], set(files)), (a, b)


def write_package(root: Path, modules: dict[str, str]) -> None:
    for dotted, text in modules.items():
        path = root.joinpath(*dotted.split("."))
        if dotted.count(".") == 0 or text.startswith("# package"):
            path.mkdir(parents=True, exist_ok=True)
            (path / "__init__.py").write_text(text)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.with_suffix(".py").write_text(text)


@pytest.mark.parametrize(
    "a_text",
    [
        "import pkg.b\n",  # absolute, module level
        "from . import b\n",  # relative
        "def f():\n    from pkg.b import thing\n",  # lazy, inside a function
    ],
)
def test_a_cycle_is_found(tmp_path: Path, a_text: str) -> None:
    write_package(tmp_path, {"pkg": "", "pkg.a": a_text, "pkg.b": "from pkg.a import x\n"})
    graph = import_graph(tmp_path, "pkg")
    assert find_cycles(graph) == [["pkg.a", "pkg.b"]]


def test_type_checking_imports_count_only_in_the_typed_graph(tmp_path: Path) -> None:
    a_text = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import thing\n"
    write_package(tmp_path, {"pkg": "", "pkg.a": a_text, "pkg.b": "from pkg.a import x\n"})
    assert find_cycles(import_graph(tmp_path, "pkg")) == []
    assert find_cycles(import_graph(tmp_path, "pkg", type_only=True)) == [["pkg.a", "pkg.b"]]
    exceptions = {("pkg.a", "pkg.b")}
    assert find_cycles(import_graph(tmp_path, "pkg", type_only=True, exceptions=exceptions)) == []


def test_relative_imports_resolve_from_the_package(tmp_path: Path) -> None:
    write_package(
        tmp_path,
        {
            "pkg": "",
            "pkg.sub": "# package\nfrom .c import y\n",
            "pkg.sub.c": "from ..a import x\n",
            "pkg.a": "from .sub import z\n",
        },
    )
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.sub"] == {"pkg.sub.c"}
    assert graph["pkg.sub.c"] == {"pkg.a"}
    assert graph["pkg.a"] == {"pkg.sub"}
    assert find_cycles(graph) == [["pkg.a", "pkg.sub", "pkg.sub.c"]]


def _layer(module: str) -> str:
    """``kalos.transport.shm`` -> ``transport``; ``kalos.client`` -> ``client``."""
    return module.split(".")[1] if module.count(".") else module


# Layers that must not import one another (either way round), through any import, typed too:
# the transports and the stores meet only below both, in kalos.shm.
_APART = {("transport", "stores"), ("stores", "transport")}
_SHM_ABOVE = {"transport", "stores", "server", "client", "async_client", "gpu", "index"}


def test_transport_and_stores_share_memory_layouts_only_through_shm() -> None:
    graph = import_graph(type_only=True)
    wrong = sorted(
        (a, b)
        for a, targets in graph.items()
        for b in targets
        if (_layer(a), _layer(b)) in _APART or (_layer(a) == "shm" and _layer(b) in _SHM_ABOVE)
    )
    assert not wrong, wrong
