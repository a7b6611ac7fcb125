"""bench/ runs on one harness: one argument parser, one paired timing, one table printer."""

from __future__ import annotations

import ast
import importlib
import time
from pathlib import Path

import pytest

from bench import _harness as H

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
#: Modules of bench/ that are not a benchmark of their own (helpers, a shared runner).
HELPERS = {"__init__", "__main__", "tars_remote"}
MODULES = sorted(
    p.stem for p in BENCH.glob("*.py") if not p.stem.startswith("_") and p.stem not in HELPERS
)


def test_one_argument_parser_in_bench() -> None:
    calls = []
    for path in sorted(BENCH.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "attr", getattr(node.func, "id", ""))
                if name == "ArgumentParser":
                    calls.append(f"{path.name}:{node.lineno}")
    assert len(calls) == 1 and calls[0].startswith("_harness.py:"), calls


@pytest.mark.parametrize("name", MODULES)
def test_every_benchmark_builds_its_parser_through_the_harness(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = importlib.import_module(f"bench.{name}")
    built: list[object] = []
    real = H.parser
    monkeypatch.setattr(H, "parser", lambda *a, **k: built.append(real(*a, **k)) or built[-1])
    parser = module.parser()
    assert built == [parser]
    prog = "python -m bench" if name == "run" else f"python -m bench.{name}"
    assert parser.format_help().startswith(f"usage: {prog}")


def test_paired_interleaves_and_times_cpu_and_wall() -> None:
    calls: list[str] = []

    def busy() -> str:
        calls.append("busy")
        end = time.process_time() + 0.03
        while time.process_time() < end:
            pass
        return "b"

    def idle() -> str:
        calls.append("idle")
        time.sleep(0.03)
        return "i"

    found = H.paired({"busy": busy, "idle": idle}, rounds=4)
    assert calls == ["busy", "idle", "idle", "busy"] * 2
    assert list(found) == ["busy", "idle"]
    for name, value in (("busy", "b"), ("idle", "i")):
        assert [t.round for t in found[name]] == [0, 1, 2, 3]
        assert {t.value for t in found[name]} == {value}
        assert all(t.wall >= 0.025 for t in found[name])
    busy_cpu = sum(t.cpu for t in found["busy"])
    idle_cpu = sum(t.cpu for t in found["idle"])
    assert busy_cpu > 0.1 and idle_cpu < busy_cpu / 3, (busy_cpu, idle_cpu)
    assert [name for name, _ in H.in_order(found)] == calls
    assert H.turn(["a", "b", "c"], 1, "rotate") == ["b", "c", "a"]
    assert H.turn(["a", "b", "c"], 1, "fixed") == ["a", "b", "c"]


def test_table_aligns_columns() -> None:
    text = H.table(
        [H.Col("name", left=True), H.Col("rate", ".1f", " b/s"), H.Col("ratio")],
        [("tiny", 866.04, H.ratio(2.0, 1.0)), None, ("heavy-tail", 15.0, None)],
    )
    lines = text.splitlines()
    assert lines == [
        "name            rate ratio",
        "tiny       866.0 b/s 2.00x",
        "",
        "heavy-tail  15.0 b/s     -",
    ]
    markdown = H.table([H.Col(""), H.Col("a")], [("x", "1")], markdown=True)
    assert markdown.splitlines() == ["|  | a |", "|---|---|", "| x | 1 |"]
