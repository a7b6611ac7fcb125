"""No code under loader/, workers/ or ipc/ touches a private attribute of a standard-library module:
the fast start (the worker server) and everything else go through public APIs only, so the next
Python cannot break them by renaming an internal (``multiprocessing.forkserver._forkserver`` was
read and written 20 times until round 4)."""

from __future__ import annotations

import ast
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("loader", "workers", "ipc")

#: Underscore names that are documented public API.
DOCUMENTED = {("os", "_exit")}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _from_stdlib(node: ast.AST) -> bool:
    """``from <standard-library module> import ...``."""
    return (
        isinstance(node, ast.ImportFrom)
        and node.level == 0
        and node.module is not None
        and node.module.split(".")[0] in sys.stdlib_module_names
    )


def _root(node: ast.expr) -> str | None:
    """The name an attribute chain, call or subscript starts from (``a`` in ``a.b().c[0]``)."""
    while True:
        if isinstance(node, ast.Attribute):
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Name):
            return node.id
        else:
            return None


def _alias_root(node: ast.expr) -> str | None:
    """The name a plain alias (``x = a.b``, no call) starts from."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _stdlib_bindings(tree: ast.Module) -> dict[str, str]:
    """Local name -> the standard-library module it stands for (imports and plain aliases)."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                if top in sys.stdlib_module_names:
                    bound[alias.asname or top] = alias.name if alias.asname else top
        elif _from_stdlib(node):
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    changed = True
    while changed:  # x: Any = _forkserver (typeshed dodged by an alias) and so on
        changed = False
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            else:
                continue
            root = _alias_root(value)
            if root in bound:
                for target in targets:
                    if isinstance(target, ast.Name) and target.id not in bound:
                        bound[target.id] = bound[root]
                        changed = True
    return bound


def private_uses(source: str, filename: str = "<string>") -> list[str]:
    """Each place ``source`` touches a private attribute of a standard-library module (or of
    what its functions return): ``file:line: module.name``."""
    tree = ast.parse(source, filename)
    bound = _stdlib_bindings(tree)
    found = []

    def report(node: ast.AST, module: str, name: str) -> None:
        if (module.split(".")[0], name) not in DOCUMENTED:
            found.append(f"{filename}:{getattr(node, 'lineno', 0)}: {module}.{name}")

    for node in ast.walk(tree):
        if _from_stdlib(node):
            for alias in node.names:
                if _private(alias.name):
                    report(node, str(node.module), alias.name)
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            root = _root(node.value)
            if root in bound:
                report(node, bound[root], node.attr)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
        ):
            root = _root(node.args[0])
            if root in bound:
                report(node, bound[root], node.args[1].value)
    return found


def test_no_private_attribute_of_the_standard_library_is_touched() -> None:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found += private_uses(path.read_text(), str(path.relative_to(ROOT)))
    assert found == [], "private standard-library attributes used:\n" + "\n".join(sorted(found))


@pytest.mark.parametrize(
    "snippet",
    [
        # round 3's worker server, as it was
        """
        from multiprocessing import forkserver as _forkserver
        from typing import Any
        forkserver: Any = _forkserver
        pid = forkserver._forkserver._forkserver_pid
        """,
        """
        import multiprocessing
        flag = getattr(multiprocessing.current_process(), "_inheriting", False)
        """,
        """
        from multiprocessing import process
        current = process.current_process()
        process.current_process()._inheriting = True
        """,
        """
        from multiprocessing import resource_tracker
        fd = getattr(resource_tracker._resource_tracker, "_fd", None)
        """,
        """
        from multiprocessing import util as _util
        from typing import Any
        util: Any = _util
        arguments = util._args_from_interpreter_flags()
        """,
        "from subprocess import _args_from_interpreter_flags",
        "import sys\nframe = sys._getframe(1)",
    ],
)
def test_the_check_sees_private_uses(snippet: str) -> None:
    """The check fails on each way the code base once reached into an internal."""
    assert private_uses(textwrap.dedent(snippet)) != []


def test_the_check_leaves_public_and_own_names_alone() -> None:
    source = """
    import os
    import sys
    import inspect
    frame = inspect.currentframe()
    while frame is not None:
        frame = frame.f_back
    os._exit(0)  # documented
    name = sys.modules["__main__"].__spec__
    class A:
        def f(self):
            return self._private
    """
    assert private_uses(textwrap.dedent(source)) == []
