"""The one harness every benchmark runs on: its argument parser, its paired timing, its tables.

* :func:`parser` builds the one kind of argument parser: a benchmark module declares its options
  in ``add_arguments(parser)`` and its ``parser()`` returns ``harness.parser(...)``;
* :func:`paired` measures candidates side by side in one run: ``rounds`` rounds in which every
  candidate runs once, in an alternating, rotating or fixed order, each call timed by
  :class:`Clock` (the whole process's CPU, every thread, by ``time.process_time``, and the wall
  time by ``time.perf_counter``: workers run beside the trainer meanwhile);
* :func:`table` / :func:`print_table` lay out every table: :class:`Col` columns, aligned,
  numbers formatted, ratios by :func:`ratio`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import psutil

T = TypeVar("T")

# ------------------------------------------------------------------------------- arguments


def parser(
    name: str,
    doc: str | None,
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
    summary: bool = True,
) -> argparse.ArgumentParser:
    """The parser of ``python -m bench.<name>`` (``name`` "" for ``python -m bench``): ``doc``'s
    first line as its description (all of it with ``summary=False``), ``add_arguments`` its
    options."""
    text = doc or ""
    built = argparse.ArgumentParser(
        prog=f"python -m bench.{name}" if name else "python -m bench",
        description=text.splitlines()[0] if summary and text else text,
    )
    if add_arguments is not None:
        add_arguments(built)
    return built


def threads(given: int | None) -> int:
    """``--threads`` as given, else the CPUs this process may run on."""
    return given or len(os.sched_getaffinity(0))


def add_threads(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=None, help="total DALI threads (CPUs)")


# ------------------------------------------------------------------------------- timing


class Clock:
    """``with Clock() as clock:``: then ``clock.cpu`` (this process, every thread) and
    ``clock.wall`` seconds of the block."""

    cpu = 0.0
    wall = 0.0

    def __enter__(self) -> Clock:
        self._started = (time.process_time(), time.perf_counter())
        return self

    def __exit__(self, *exc: object) -> None:
        self.cpu = time.process_time() - self._started[0]
        self.wall = time.perf_counter() - self._started[1]

    def lap(self) -> float:
        """Wall seconds since the block began (inside it)."""
        return time.perf_counter() - self._started[1]


@dataclass(frozen=True)
class Timed(Generic[T]):
    """One call of a candidate: what it returned, and its CPU and wall seconds."""

    value: T
    cpu: float  # the whole process's CPU, every thread
    wall: float
    round: int
    index: int  # the call's place in the run, from 0


ORDERS = ("alternate", "rotate", "fixed")


def turn(names: Sequence[str], round_: int, order: str) -> list[str]:
    """The candidates' order in round ``round_``: ``alternate`` reverses every other round,
    ``rotate`` starts one later each round, ``fixed`` keeps it."""
    if order == "alternate":
        return list(names) if round_ % 2 == 0 else list(reversed(names))
    if order == "rotate":
        shift = round_ % len(names)
        return list(names[shift:]) + list(names[:shift])
    if order == "fixed":
        return list(names)
    raise ValueError(f"order {order!r}: one of {ORDERS}")


def paired(
    candidates: Mapping[str, Callable[[], T]],
    rounds: int,
    order: str = "alternate",
    report: Callable[[str, Timed[T]], None] | None = None,
) -> dict[str, list[Timed[T]]]:
    """Every candidate once per round, ``rounds`` rounds, interleaved in ``order`` (see
    :func:`turn`); each call timed by :class:`Clock`. ``report(name, timed)`` after each call.
    Returns each candidate's calls, in its rounds' order."""
    found: dict[str, list[Timed[T]]] = {name: [] for name in candidates}
    index = 0
    for round_ in range(rounds):
        for name in turn(list(candidates), round_, order):
            with Clock() as clock:
                value = candidates[name]()
            timed = Timed(value, clock.cpu, clock.wall, round_, index)
            index += 1
            found[name].append(timed)
            if report is not None:
                report(name, timed)
    return found


def in_order(found: Mapping[str, list[Timed[T]]]) -> list[tuple[str, Timed[T]]]:
    """Every call of :func:`paired`'s result, in the order they ran."""
    calls = [(name, timed) for name, made in found.items() for timed in made]
    return sorted(calls, key=lambda call: call[1].index)


def ratios(found: Mapping[str, list[Timed[Any]]], top: str, bottom: str, key: Any) -> list[float]:
    """Per round, ``key(top's value) / key(bottom's value)``."""
    return [key(a.value) / key(b.value) for a, b in zip(found[top], found[bottom], strict=True)]


def print_ratios(label: str, values: Sequence[float], target: float) -> None:
    """Each pair's ratio, and their median against ``target`` (at least)."""
    median = statistics.median(values)
    print(f"{label} per pair: {runs(values)}")
    print(
        f"median {median:.3f} (range {min(values):.2f}-{max(values):.2f}); target >= {target:g}: "
        f"{'met' if median >= target else 'MISSED'}"
    )


def process_cpu(processes: Iterable[psutil.Process]) -> float:
    """User plus system CPU seconds of ``processes`` so far (every thread of each)."""
    total = 0.0
    for process in processes:
        times = process.cpu_times()
        total += times.user + times.system
    return total


def load_average() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


# ------------------------------------------------------------------------------- tables


@dataclass(frozen=True)
class Col:
    """A column: its header; ``fmt`` the format spec of its numbers (``.2f``, ``,``), ``unit``
    what follows each (``x``, `` b/s``); ``left`` aligns it left (text), else right."""

    name: str
    fmt: str = ""
    unit: str = ""
    left: bool = False

    def cell(self, value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, str):
            return value
        return f"{value:{self.fmt}}{self.unit}"


def table(
    columns: Sequence[Col], rows: Iterable[Sequence[Any] | None], markdown: bool = False
) -> str:
    """The rows under the columns' headers, each column as wide as its widest cell; a ``None``
    row is a blank line (between groups). ``markdown``: a Markdown table instead."""
    cells = [
        None if row is None else [c.cell(v) for c, v in zip(columns, row, strict=True)]
        for row in rows
    ]
    if markdown:
        lines = ["| " + " | ".join(c.name for c in columns) + " |"]
        lines.append("|" + "|".join("---" for _ in columns) + "|")
        lines += ["| " + " | ".join(row) + " |" for row in cells if row is not None]
        return "\n".join(lines)
    widths = [
        max([len(c.name), *(len(row[i]) for row in cells if row is not None)])
        for i, c in enumerate(columns)
    ]

    def line(texts: Sequence[str]) -> str:
        parts = [
            f"{text:<{width}}" if column.left else f"{text:>{width}}"
            for column, text, width in zip(columns, texts, widths, strict=True)
        ]
        return " ".join(parts).rstrip()

    out = [line([c.name for c in columns])]
    out += ["" if row is None else line(row) for row in cells]
    return "\n".join(out)


def print_table(
    columns: Sequence[Col], rows: Iterable[Sequence[Any] | None], markdown: bool = False
) -> None:
    print(table(columns, rows, markdown), flush=True)


def ratio(value: float, base: float | None, fmt: str = ".2f") -> str:
    """``value / base`` as ``1.23x`` (``-`` without a base)."""
    return f"{value / base:{fmt}}x" if base else "-"


def spread(values: Sequence[float], fmt: str = ".1f", span: str = ".0f") -> str:
    """The median and (range) of ``values``."""
    return f"{statistics.median(values):{fmt}} ({min(values):{span}}-{max(values):{span}})"


def runs(values: Iterable[float], fmt: str = ".2f") -> str:
    return " ".join(f"{v:{fmt}}" for v in values)
