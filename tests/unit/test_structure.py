"""The code's shape, as the design asks it (no processes): small functions, a thin facade."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_no_function_under_loader_workers_or_ipc_is_over_60_lines() -> None:
    """Its body (docstring included), that is: a signature of one parameter a line is not
    what makes a function hard to read."""
    long = []
    for package in ("loader", "workers", "ipc"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    assert node.end_lineno is not None
                    lines = node.end_lineno - node.body[0].lineno + 1
                    if lines > 60:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} {lines}")
    assert not long, long


def test_the_loader_is_a_facade() -> None:
    lines = (ROOT / "loader" / "_loader.py").read_text().count("\n")
    assert lines <= 350, f"loader/_loader.py has {lines} lines: what it grew belongs in the run"


def _tree(relative: str) -> ast.Module:
    return ast.parse((ROOT / relative).read_text(encoding="utf-8"))


def test_the_facade_holds_one_root() -> None:
    """``Loader`` imports only the run from ``loader.run`` and the user's epoch objects from
    the face's ``loader._epochs``, nothing of ``torch.distributed``, and its constructor hands
    its parameters whole to ``LoaderConfig.build``, whose fields declare them
    (tests/unit/loader/config/test_keywords.py keeps the two lists equal): ``locals()`` read
    once, first, before any other name exists, and no parameter forwarded by name."""
    tree = _tree("loader/_loader.py")
    from_run, from_epochs, names = set(), set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "run":
            from_run.update(alias.name for alias in node.names)
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module == "_epochs":
            from_epochs.update(alias.name for alias in node.names)
        if isinstance(node, ast.Name):
            names.add(node.id)
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
    assert from_run == {"Run"}
    assert from_epochs == {"EpochIterator", "EpochSampler"}
    assert not {n for n in names if "distributed" in n or n in ("gather", "group_size")}
    init = next(
        n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "__init__"
    )
    reads = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "locals"
    ]
    first = init.body[0]
    assert len(reads) == 1 and reads[0] in list(ast.walk(first)), "locals() only, first, once"
    assert isinstance(first, ast.Assign) and isinstance(first.value, ast.Call)
    build = next(
        n
        for n in ast.walk(init)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "build"
    )
    assert not build.args and [k.arg for k in build.keywords] == [None]  # build(**given)


def test_one_module_decides_the_layout() -> None:
    """After validation, ``num_workers`` (with the threads) changes in one module: the run's
    layout plan, the only caller of ``LoaderConfig.with_layout``."""
    callers = set()
    for path in sorted((ROOT / "loader").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr == "with_layout":
                callers.add(str(path.relative_to(ROOT)))
    assert callers == {"loader/run/_layout.py"}


def test_run_passes_nothing_through() -> None:
    """No method of ``Run`` only hands its call to one of its fields (``return
    self.x.same(...)``): what it asks of its parts, it asks for a reason of its own."""
    tree = _tree("loader/run/_run.py")
    run = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Run")
    relays = []
    for method in (n for n in run.body if isinstance(n, ast.FunctionDef)):
        body = [
            s
            for s in method.body
            if not isinstance(s, ast.Expr) or not isinstance(s.value, ast.Constant)
        ]
        if len(body) != 1:
            continue
        value = getattr(body[0], "value", None)
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute):
            held = value.func.value
            if (
                isinstance(held, ast.Attribute)
                and isinstance(held.value, ast.Name)
                and held.value.id == "self"
            ):
                relays.append(f"{method.name} -> self.{held.attr}.{value.func.attr}")
    assert relays == []


def test_unit_tests_mirror_the_code() -> None:
    """``tests/unit/<package>/<sub-package>/test_<module>.py``: every folder of unit tests is a
    package of the code (the tests of the whole tree, such as this one, stay at the top)."""
    unit = ROOT / "tests" / "unit"
    folders = [p.parent for p in unit.rglob("test_*.py") if p.parent != unit]
    assert folders, "no unit test mirrors a package"
    for folder in folders:
        package = ROOT / folder.relative_to(unit)
        assert (package / "__init__.py").exists(), f"{folder} mirrors no package of the code"
