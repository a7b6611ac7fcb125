"""A worker's session owns its fields: outside ``loader/engine/_session.py``, code reads a
:class:`~loader.engine._session.WorkerSession` only through its public methods and properties,
and the policies (healing, failures, stats) read a :class:`~loader.engine._session.SessionView`
snapshot, never a session (an ast scan; no processes)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
SESSION_MODULE = ROOT / "loader" / "engine" / "_session.py"
#: Policies that take a snapshot: they never name a session.
SNAPSHOT_POLICIES = ("_failures.py", "_healing.py", "_stats.py")


def public_interface(path: Path = SESSION_MODULE) -> set[str]:
    """The names of ``WorkerSession``'s public methods and properties."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    (cls,) = (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "WorkerSession")
    return {
        node.name
        for node in cls.body
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")
    }


def _annotation_kind(annotation: ast.expr | None) -> str | None:
    """ "one" for ``WorkerSession`` (or ``... | None``), "many" for a container of them."""
    if annotation is None:
        return None
    text = ast.unparse(annotation)
    if "WorkerSession" not in text:
        return None
    return "many" if "[" in text else "one"


class _Bindings:
    """Which names of a module stand for a session, or for a sequence of sessions (flow- and
    scope-insensitive: a name bound to a session anywhere in the module is one everywhere)."""

    def __init__(self) -> None:
        self.one: set[str] = set()
        self.many: set[str] = set()

    def is_many(self, node: ast.expr) -> bool:
        if isinstance(node, ast.Attribute):
            return node.attr == "sessions"
        if isinstance(node, ast.Name):
            return node.id in self.many
        if isinstance(node, (ast.ListComp, ast.GeneratorExp)):
            return self.is_one(node.elt)
        return False

    def is_one(self, node: ast.expr) -> bool:
        if isinstance(node, ast.Name):
            return node.id in self.one
        if isinstance(node, ast.Subscript):
            return self.is_many(node.value)
        if isinstance(node, ast.NamedExpr):
            return self.is_one(node.value)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args:
            if node.func.id in ("min", "max"):
                return self.is_many(node.args[0])
            if node.func.id == "next":
                return self.is_many(node.args[0])
        return False

    def learn(self, tree: ast.AST) -> bool:
        """One pass; True when it found a new name."""
        before = (len(self.one), len(self.many))
        for node in ast.walk(tree):
            if isinstance(node, ast.arg):
                kind = _annotation_kind(node.annotation)
                if kind is not None:
                    (self.one if kind == "one" else self.many).add(node.arg)
            elif isinstance(node, (ast.For, ast.comprehension)):
                self._learn_loop(node.target, node.iter)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr)):
                value = node.value
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Name) and value is not None:
                        if self.is_one(value):
                            self.one.add(target.id)
                        elif self.is_many(value):
                            self.many.add(target.id)
        return (len(self.one), len(self.many)) != before

    def _learn_loop(self, target: ast.expr, iterable: ast.expr) -> None:
        if self.is_many(iterable) and isinstance(target, ast.Name):
            self.one.add(target.id)
        elif (
            isinstance(iterable, ast.Call)
            and isinstance(iterable.func, ast.Name)
            and iterable.func.id == "enumerate"
            and iterable.args
            and self.is_many(iterable.args[0])
            and isinstance(target, ast.Tuple)
            and isinstance(target.elts[-1], ast.Name)
        ):
            self.one.add(target.elts[-1].id)


def session_reads(source: str) -> list[tuple[int, str]]:
    """``(line, attribute)`` of every attribute of a session that ``source`` reads (or
    writes, or calls)."""
    tree = ast.parse(source)
    bindings = _Bindings()
    while bindings.learn(tree):
        pass
    return [
        (node.lineno, node.attr)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and bindings.is_one(node.value)
    ]


def _loader_modules() -> list[Path]:
    return [p for p in sorted((ROOT / "loader").rglob("*.py")) if p != SESSION_MODULE]


def test_no_module_reads_a_sessions_private_fields() -> None:
    allowed = public_interface()
    wrong = []
    for path in _loader_modules():
        for line, attr in session_reads(path.read_text(encoding="utf-8")):
            if attr not in allowed:
                wrong.append(f"{path.relative_to(ROOT)}:{line} .{attr}")
    assert wrong == []


def test_the_scan_sees_the_engines_reads() -> None:
    """The scan is not vacuous: it finds the engine's many reads, in each module that uses
    sessions, and the interface it checks them against."""
    assert {"index", "handle", "view", "go", "on_batch"} <= public_interface()
    counts = {
        path.name: len(session_reads(path.read_text(encoding="utf-8")))
        for path in _loader_modules()
    }
    assert sum(counts.values()) > 60, counts
    for name in ("_coordinator.py", "_order.py", "_releases.py", "_roster.py", "_routing.py"):
        assert counts[name] > 0, name
    for name in ("_waiting.py", "_agreement.py"):
        assert counts[name] > 0, name


PLANTED = """
from loader.engine._session import WorkerSession


def f(session: WorkerSession, sessions: list[WorkerSession]) -> None:
    session._queue
    session.up
    for s in sessions:
        s.counters
    sessions[0].target
    found = next((t for t in sessions if t.up), None)
    found.heard_at
    for index, other in enumerate(sessions):
        other.shard
    late = min(sessions, key=lambda w: 0)
    late.epoch
    text = "not a session"
    text.upper()


class C:
    def g(self) -> list[object]:
        blocked = [self.sessions[i] for i in range(2)]
        blocked[0].random
        return [w.delivered for w in self.sessions]
"""


def test_a_planted_read_of_a_field_is_found(tmp_path: Path) -> None:
    path = tmp_path / "planted.py"
    path.write_text(PLANTED)
    allowed = public_interface()
    wrong = sorted(attr for _, attr in session_reads(path.read_text()) if attr not in allowed)
    assert wrong == sorted(
        ["_queue", "counters", "target", "heard_at", "shard", "epoch", "random", "delivered"]
    )


def test_a_public_method_is_read_from_the_session_module_itself(tmp_path: Path) -> None:
    """The interface comes from the class: a method made private is no longer allowed."""
    module = tmp_path / "_session.py"
    module.write_text(
        "class WorkerSession:\n"
        "    def view(self): ...\n"
        "    @property\n    def up(self): ...\n"
        "    def _private(self): ...\n"
    )
    assert public_interface(module) == {"view", "up"}


def test_policies_read_a_snapshot_not_a_session() -> None:
    for name in SNAPSHOT_POLICIES:
        text = (ROOT / "loader" / "engine" / name).read_text(encoding="utf-8")
        assert "WorkerSession" not in text, name
