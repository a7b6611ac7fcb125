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
