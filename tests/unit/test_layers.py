"""The trainer side in layers: no import circle anywhere in ``loader/``, ``workers/`` and
``ipc/`` (imports inside functions count; ``if TYPE_CHECKING:`` imports do not), and every
import in ``loader/`` goes down the layers that ``loader/__init__.py`` draws."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("loader", "workers", "ipc")

#: loader's layers, bottom first; a module may import its own layer and those below.
#: ``run`` and ``observe`` share a floor and do not import each other.
LAYERS = {
    "loader.errors": 0,
    "loader.config": 1,
    "loader.processes": 2,
    "loader.engine": 3,
    "loader.observe": 4,
    "loader.run": 4,
    "loader._epochs": 5,
    "loader._loader": 5,
    "loader._ndd": 5,
    "loader.sample": 5,
    "loader.tars": 5,
    "loader.testing": 5,
    "loader.hf": 5,
    "loader": 5,  # the package's __init__: the public face
    "loader.cli": 6,
    "loader.__main__": 7,
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:``."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and (
            (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
            or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")
        ):
            for child in node.body:
                skipped.update(id(n) for n in ast.walk(child))
    return skipped


def import_graph(
    modules: dict[str, Path] | None = None, *, type_only: bool = False, foreign: bool = False
) -> dict[str, set[str]]:
    """Every module of ours and the modules of ours it imports (at any depth of its code).
    ``type_only``: ``if TYPE_CHECKING:`` imports count too; ``foreign``: so do modules not ours
    (``nvidia.dali...``)."""
    if modules is None:
        modules = {
            _module_name(path): path
            for package in PACKAGES
            for path in (ROOT / package).rglob("*.py")
        }
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skipped = set() if type_only else _type_checking_nodes(tree)
        package = name if _is_package(path) else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    origin = ".".join(base + ([node.module] if node.module else []))
                else:
                    origin = node.module or ""
                for alias in node.names:
                    submodule = f"{origin}.{alias.name}"
                    targets.add(submodule if submodule in modules else origin)
        graph[name] = {t for t in targets if (foreign or t in modules) and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def layer_of(module: str) -> str | None:
    best = None
    for prefix in LAYERS:
        if (module == prefix or module.startswith(prefix + ".")) and (
            best is None or len(prefix) > len(best)
        ):
            best = prefix
    return best


def test_no_import_circle() -> None:
    graph = import_graph()
    assert len(graph) > 60 and "workers.sources._sharded" in graph  # sub-packages are read
    assert cycles(graph) == []


def test_a_circle_is_found(tmp_path: Path) -> None:
    """The finder itself: two modules that import each other, one inside a function."""
    package = tmp_path / "loop"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from . import b\n")
    (package / "b.py").write_text("def f():\n    from .a import g\n")
    (package / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x\n"
    )
    modules = {
        f"loop.{path.stem}" if path.stem != "__init__" else "loop": path
        for path in package.glob("*.py")
    }
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        graph = import_graph(modules)
    finally:
        ROOT = saved
    assert cycles(graph) == [["loop.a", "loop.b"]]
    assert graph["loop.c"] == set()


def test_loader_imports_go_down_its_layers() -> None:
    graph = import_graph()
    wrong = []
    for module, targets in graph.items():
        if not module.startswith("loader"):
            continue
        mine = layer_of(module)
        assert mine is not None, f"{module} is in no layer: add it to LAYERS"
        for target in targets:
            theirs = layer_of(target)
            if theirs is None:
                continue  # workers, ipc
            if LAYERS[theirs] > LAYERS[mine] or (
                {mine, theirs} == {"loader.run", "loader.observe"}
            ):
                wrong.append(f"{module} ({mine}) imports {target} ({theirs})")
    assert wrong == []


def test_the_packages_import_one_way() -> None:
    graph = import_graph()
    for module, targets in graph.items():
        roots = {target.split(".")[0] for target in targets}
        if module.startswith("ipc"):
            assert not roots & {"loader", "workers"}, module
        if module.startswith("workers"):
            assert "loader" not in roots, module


def test_loader_has_at_most_eight_modules_at_its_top() -> None:
    top = sorted(path.name for path in (ROOT / "loader").glob("*.py"))
    assert len(top) <= 8, top


@pytest.mark.parametrize(
    "package", sorted(p.parent.name for p in (ROOT / "loader").glob("*/__init__.py"))
)
def test_each_layer_says_what_it_owns_and_may_import(package: str) -> None:
    """Its face: what it owns, what it may import, and (sorted) what others may use of it."""
    tree = ast.parse((ROOT / "loader" / package / "__init__.py").read_text(encoding="utf-8"))
    doc = ast.get_docstring(tree)
    assert doc is not None and "May import" in doc, package
    names = _all_of(tree)
    assert names, f"loader/{package}/__init__.py has no __all__"
    assert names == sorted(names, key=_ruff_order), package


def test_workers_has_at_most_eight_modules_at_its_top() -> None:
    top = sorted(path.name for path in (ROOT / "workers").glob("*.py"))
    assert len(top) <= 8, top


def _all_of(tree: ast.Module) -> list[str] | None:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "__all__" for target in node.targets
        ):
            names = ast.literal_eval(node.value)
            return list(names)
    return None


def _ruff_order(name: str) -> tuple[int, str]:
    """``__all__``'s order, as ruff's RUF022 keeps it: CONSTANTS, then Classes, then the rest."""
    return (0 if name.isupper() else 1 if name[:1].isupper() else 2, name)


@pytest.mark.parametrize(
    "package",
    sorted(
        str(p.parent.relative_to(ROOT / "workers"))
        for p in (ROOT / "workers").glob("*/**/__init__.py")
    ),
)
def test_each_workers_subpackage_has_a_face(package: str) -> None:
    """Its ``__init__`` says what it owns and which process runs it, and names, sorted, what
    other packages may use of it."""
    tree = ast.parse((ROOT / "workers" / package / "__init__.py").read_text(encoding="utf-8"))
    doc = ast.get_docstring(tree)
    assert doc is not None and "May import" in doc and "Runs in" in doc, package
    names = _all_of(tree)
    assert names, f"workers/{package}/__init__.py has no __all__"
    assert names == sorted(names, key=_ruff_order), package


def test_workers_has_one_entry_point() -> None:
    """One module defines the worker process's entry point, ``run_worker``, and says so."""
    defining = {}
    for path in sorted((ROOT / "workers").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if any(isinstance(n, ast.FunctionDef) and n.name == "run_worker" for n in tree.body):
            defining[str(path.relative_to(ROOT))] = ast.get_docstring(tree) or ""
    assert list(defining) == ["workers/process/_entry.py"]
    assert "one entry point" in defining["workers/process/_entry.py"].splitlines()[0]


def private_imports(graph: dict[str, set[str]]) -> list[str]:
    """Each import of another package's private module: a module goes through a package's face
    (its ``__init__``) or its public modules, never ``_x`` of its parent package, of a sibling
    or of a sub-package."""
    private = []
    for module, targets in graph.items():
        path = ROOT / Path(*module.split("."))
        mine = module if (path / "__init__.py").exists() else module.rpartition(".")[0]
        for target in targets:
            theirs, _, last = target.rpartition(".")
            if last.startswith("_") and not last.startswith("__") and theirs != mine:
                private.append(f"{module} imports {target}")
    return sorted(private)


def test_no_module_imports_another_packages_private_module() -> None:
    graph = import_graph()
    assert "loader.run._run" in graph and "workers.sources._sharded" in graph
    assert private_imports(graph) == []


def test_a_private_import_is_found() -> None:
    """The check itself, on the real graph with one planted import: the facade reaching into
    the engine's stats module, as it used to."""
    graph = import_graph()
    graph["loader._loader"] = graph["loader._loader"] | {"loader.engine._stats"}
    graph["loader.run._run"] = graph["loader.run._run"] | {"loader.run._epochs"}  # its own
    assert private_imports(graph) == ["loader._loader imports loader.engine._stats"]


def test_importing_workers_imports_no_dali() -> None:
    """The trainer imports ``workers``; DALI is imported in the workers only."""
    code = "import sys, workers; assert 'nvidia.dali' not in sys.modules, 'DALI imported'"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


#: Writes to attributes of objects that are not ours whose names our classes also use.
FOREIGN_WRITES = {
    ("workers/sources/files/_files.py", "filename"),  # an OSError's filename
    ("loader/cli/_job.py", "total"),  # a tqdm bar's total (tqdm's way to change it)
}


def _attribute_owners() -> dict[str, set[str]]:
    """Each attribute name our classes define (``self.x = ...``, a class-level annotation) ->
    the packages of those classes."""
    owners: dict[str, set[str]] = {}
    for package, tree in _package_trees():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for node in ast.walk(cls):
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    owners.setdefault(node.target.id, set()).add(package)
                for target in _targets(node):
                    if isinstance(target.value, ast.Name) and target.value.id == "self":
                        owners.setdefault(target.attr, set()).add(package)
    return owners


def _package_trees() -> list[tuple[str, ast.Module]]:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = _module_name(path)
            found.append((name if _is_package(path) else name.rpartition(".")[0], path))
    return [(package, ast.parse(path.read_text(encoding="utf-8"))) for package, path in found]


def _targets(node: ast.AST) -> list[ast.Attribute]:
    """The attributes a statement assigns to (``a.b = ``, ``a.b += ``, ``a.b, c.d = ``)."""
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    else:
        return []
    flat: list[ast.expr] = []
    for target in targets:
        flat.extend(target.elts if isinstance(target, ast.Tuple) else [target])
    return [t for t in flat if isinstance(t, ast.Attribute)]


def test_no_module_writes_the_fields_of_another_packages_objects() -> None:
    """An object's fields change through its own methods: outside ``self``, a module writes an
    attribute only of objects of its own package (or of objects that are not ours)."""
    owners = _attribute_owners()
    wrong = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = _module_name(path)
            mine = name if _is_package(path) else name.rpartition(".")[0]
            relative = str(path.relative_to(ROOT))
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                for target in _targets(node):
                    if isinstance(target.value, ast.Name) and target.value.id in ("self", "cls"):
                        continue
                    theirs = owners.get(target.attr)
                    if theirs is None or mine in theirs:
                        continue  # not ours (an exception's, DALI's), or our own package's
                    if (relative, target.attr) not in FOREIGN_WRITES:
                        wrong.append(f"{relative}:{node.lineno} {ast.unparse(target)}")
    assert wrong == []


def test_no_class_is_over_350_lines() -> None:
    long = []
    for _package, tree in _package_trees():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            lines = (cls.end_lineno or cls.lineno) - cls.lineno + 1
            if lines > 350:
                long.append(f"{cls.name}: {lines}")
    assert long == []


def test_no_module_of_the_sources_is_over_550_lines() -> None:
    """The data layer is a face over its wings: a module that grows past this holds two things."""
    long = []
    for path in sorted((ROOT / "workers" / "sources").rglob("*.py")):
        lines = path.read_text(encoding="utf-8").count("\n")
        if lines > 550:
            long.append(f"{path.relative_to(ROOT)}: {lines}")
    assert long == []


#: Imports that no module may make, type-only ones and those inside functions included:
#: (importer, imported), each a module or a package and everything under it. The data code
#: knows nothing of DALI (the capture layer puts its batches under DALI), and the DALI adapter
#: nothing of the data code.
NEVER = (
    ("workers.sources", "workers.dali"),
    ("workers.sources", "workers.transport"),
    ("workers.sources", "nvidia.dali"),
    ("workers.dali", "workers.sources"),
)


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def forbidden_imports(graph: dict[str, set[str]]) -> list[str]:
    """Each import of ``graph`` that :data:`NEVER` forbids."""
    return sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        for target in targets
        for importer, imported in NEVER
        if _under(module, importer) and _under(target, imported)
    )


def test_the_never_rules_hold() -> None:
    graph = import_graph(type_only=True, foreign=True)
    assert "nvidia.dali.experimental.dynamic" in graph["workers.dali"]  # DALI's are read
    assert forbidden_imports(graph) == []


def test_a_forbidden_import_is_found() -> None:
    """The check itself, on the real graph with the imports it forbids planted (as they were)."""
    graph = import_graph(type_only=True, foreign=True)
    graph["workers.sources.plan._sampling"] = graph["workers.sources.plan._sampling"] | {
        "workers.transport",
        "nvidia.dali.experimental.dynamic",
        "workers.spec",  # allowed
    }
    graph["workers.dali"] = graph["workers.dali"] | {"workers.sources"}
    graph["workers.sources._mix"] = graph["workers.sources._mix"] | {"workers.dali"}
    assert forbidden_imports(graph) == [
        "workers.dali imports workers.sources",
        "workers.sources._mix imports workers.dali",
        "workers.sources.plan._sampling imports nvidia.dali.experimental.dynamic",
        "workers.sources.plan._sampling imports workers.transport",
    ]


def test_type_only_and_function_imports_are_read_for_the_never_rules(tmp_path: Path) -> None:
    """An ``if TYPE_CHECKING:`` import and one inside a function, as ``dali.py`` and
    ``_sampling.py`` had them, are in the graph the rules read."""
    package = tmp_path / "workers"
    (package / "sources").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sources" / "__init__.py").write_text("")
    (package / "dali.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sources import B\n"
    )
    (package / "sources" / "_s.py").write_text(
        "def f():\n    import nvidia.dali.experimental.dynamic as ndd\n"
    )
    modules = {_module_name_in(tmp_path, path): path for path in package.rglob("*.py")}
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        graph = import_graph(modules, type_only=True, foreign=True)
        plain = import_graph(modules)
    finally:
        ROOT = saved
    assert forbidden_imports(graph) == [
        "workers.dali imports workers.sources",
        "workers.sources._s imports nvidia.dali.experimental.dynamic",
    ]
    assert forbidden_imports(plain) == []  # (the circle check leaves type-only imports out)


def _module_name_in(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)
