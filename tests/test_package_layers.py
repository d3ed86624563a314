"""The package's import structure: no import loops between modules, and no lower layer importing a higher one.

Layers, lowest first (DESIGN.md): ``errors``, ``model`` and ``private`` (no imports from the package) < ``comm``
(runs on every rank under plain mpiexec: no IPython, widgets, cluster), ``remote`` (run over ssh) and ``ipp`` (the
one door to ipyparallel) < ``engine`` (each rank's side of a cell), ``controller`` and ``widgets`` (renders what it
is handed) < ``cluster`` < ``emulate``, ``server`` and ``plan`` (siblings) < ``magics`` and ``cli`` (the two faces
of the plan: neither imports the other) < the package root. Imports inside functions count as much as those at the
top (a lazy import is still a dependency); imports under ``if TYPE_CHECKING:`` do not for the layers, but do for
loops (a circle hidden from the interpreter is still one for the reader). Read from the source with :mod:`ast`, so
a loop is found whether or not a test happens to execute it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import taco_notebook

PACKAGE = Path(taco_notebook.__file__).parent
LAYERS = ["_version", "errors", "model", "private", "comm", "remote", "ipp", "engine", "controller", "widgets",
          "cluster", "emulate", "server", "plan", "magics", "cli"]
RANK = {"_version": 0, "errors": 0, "model": 0, "private": 0, "comm": 1, "remote": 1, "ipp": 1, "engine": 2,
        "controller": 2, "widgets": 2, "cluster": 3, "emulate": 4, "server": 4, "plan": 4, "magics": 5, "cli": 5}
NO_IPYTHON = ("comm", "remote", "plan", "cli")  # comm runs on every rank, remote over ssh; plan is shared by
# the magics and the command line


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if "labextension" not in p.parts}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(name: str, path: Path, known: set[str], type_checking: bool = False) -> set[str]:
    """The package's modules that ``name`` imports (also under ``if TYPE_CHECKING:`` when ``type_checking``)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node) and not type_checking:
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "taco_notebook")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "taco_notebook":
                for alias in node.names:  # "from . import session" imports the submodule
                    sub = f"{target}.{alias.name}"
                    found.add(sub if sub in known else target)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {m for m in found if m in known and m != name}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


@pytest.fixture(scope="module")
def typed_graph() -> dict[str, set[str]]:
    """The graph with the imports under ``if TYPE_CHECKING:`` as well."""
    modules = _modules()
    return {name: _imports(name, path, set(modules), type_checking=True) for name, path in modules.items()}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in RANK else None


def test_the_graph_is_read(graph: dict[str, set[str]]) -> None:
    """The reader sees real edges (a parser that found nothing would pass every other test)."""
    assert "taco_notebook.comm.config" in graph["taco_notebook.comm"]
    assert "taco_notebook.cluster.session" in graph["taco_notebook.cluster.cells.run"]
    assert all(layer in {_layer(m) for m in graph} for layer in LAYERS)


def test_no_lower_layer_imports_a_higher_one(graph: dict[str, set[str]]) -> None:
    wrong = []
    for module, targets in graph.items():
        layer = _layer(module)
        if layer is None:
            continue
        for target in targets:
            other = _layer(target)
            if target == "taco_notebook" or (other is not None and other != layer and RANK[other] >= RANK[layer]):
                wrong.append(f"{module} ({layer}) imports {target} ({other or 'the package root'})")
    assert not wrong, "\n".join(sorted(wrong))


def _loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components: any component of more than one module is a loop. A package's
    ``__init__`` importing its own submodules (which import their siblings) is not one: only edges that leave the
    package __init__ upward count."""
    edges = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    loops: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                connect(w)
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
                loops.append(sorted(component))

    for v in edges:
        if v not in index:
            connect(v)
    return loops


def test_no_import_loops(graph: dict[str, set[str]]) -> None:
    loops = _loops(graph)
    assert not loops, "import loops: " + "; ".join(" <-> ".join(c) for c in loops)


def test_no_import_loops_even_for_the_type_checker(graph: dict[str, set[str]],
                                                  typed_graph: dict[str, set[str]]) -> None:
    """A circle such as ``session -> members -> membership -(TYPE_CHECKING)-> session`` is one the interpreter
    never sees. A module that needs another's type for its hints only still depends on it: the two may not
    depend on each other, whether the import is lazy, at the top or under ``if TYPE_CHECKING:``."""
    tree, describe = "taco_notebook.cluster.processes.tree", "taco_notebook.cluster.describe"
    assert describe in typed_graph[tree] and describe not in graph[tree]  # the TYPE_CHECKING edges are read
    loops = _loops(typed_graph)
    assert not loops, "import loops (counting TYPE_CHECKING imports): " + "; ".join(" <-> ".join(c) for c in loops)


def test_no_module_over_400_lines() -> None:
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if "labextension" not in p.parts and (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"modules over 400 lines (split them): {long}"


def _third_party_imports(path: Path) -> set[str]:
    """The top-level names of what ``path`` imports from outside the package (TYPE_CHECKING blocks included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_no_module_imports_another_modules_private_name() -> None:
    """What modules share is public in the module that owns it: ``from .checked import _refuse`` is a name the
    owner may change without looking for users."""
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "labextension" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("taco_notebook")):
                wrong += [f"{path.relative_to(PACKAGE)}:{node.lineno} imports {alias.name}" for alias in node.names
                          if alias.name.startswith("_") and not alias.name.startswith("__")]
    assert not wrong, "\n".join(wrong)


def _cluster_fields() -> set[str]:
    """The attributes :class:`TacoCluster` sets on itself."""
    tree = ast.parse((PACKAGE / "cluster" / "session.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TacoCluster")
    return {node.attr for node in ast.walk(cls) if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name) and node.value.id == "self"}


def test_only_a_cluster_writes_its_own_fields() -> None:
    """``TacoCluster`` changes through its own verbs (``request``, ``fail``, ``set_run``…): no other module
    assigns to a field of an object it calls a cluster (subclasses write ``self``'s)."""
    fields = _cluster_fields()
    assert {"pending", "error", "cluster_id", "mpi", "ranks"} <= fields
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "labextension" in path.parts or path == PACKAGE / "cluster" / "session.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and node.attr in fields
                    and isinstance(node.value, ast.Name) and "cluster" in node.value.id.lower()):
                wrong.append(f"{path.relative_to(PACKAGE)}:{node.lineno} sets {node.value.id}.{node.attr}")
    assert not wrong, "\n".join(wrong)


def test_only_the_adapter_imports_ipyparallel_or_ipykernel() -> None:
    """One door to upstream internals: every import of ipyparallel or ipykernel sits in ``taco_notebook/ipp/``."""
    wrong = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                   if "labextension" not in p.parts and "ipp" != p.relative_to(PACKAGE).parts[0]
                   and _third_party_imports(p) & {"ipyparallel", "ipykernel"})
    assert not wrong, f"modules importing ipyparallel or ipykernel outside taco_notebook/ipp/: {wrong}"


@pytest.mark.parametrize("layer", NO_IPYTHON)
def test_layers_that_run_without_ipython_never_import_it(layer: str) -> None:
    """``plan`` is the road of shell commands as well as of the magics: it raises ``OptionError``, never
    IPython's ``UsageError``; the command line never goes through IPython."""
    wrong = sorted(str(p.relative_to(PACKAGE)) for p in (PACKAGE / layer).rglob("*.py")
                   if "IPython" in _third_party_imports(p))
    assert not wrong, f"{layer} modules importing IPython: {wrong}"


EMULATOR = "taco_notebook.emulate"
COMMAND_LINES = ("taco_notebook.cli",)  # the command line that drives the emulator


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_no_production_module_imports_the_emulator(graph: dict[str, set[str]]) -> None:
    """Emulated nodes are a tool beside production (DESIGN.md): only the emulator itself and the command line
    that drives it import it. A profile learns about emulated hosts from the launch overlay they publish as data
    (:mod:`taco_notebook.cluster.launch.overlay`), so production code runs where the emulator is not shipped."""
    def command_line(module: str) -> bool:
        return any(_within(module, cli) for cli in COMMAND_LINES)

    assert any(_within(t, EMULATOR) for m, ts in graph.items() if command_line(m) for t in ts), \
        "the reader sees no command line importing the emulator"
    wrong = sorted(f"{module} imports {target}" for module, targets in graph.items() for target in targets
                   if _within(target, EMULATOR) and not _within(module, EMULATOR)
                   and not command_line(module))
    assert not wrong, "production imports the emulator:\n" + "\n".join(wrong)
