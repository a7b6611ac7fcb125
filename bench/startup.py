"""Time to the first batch of a training script's loaders: ``python -m bench.startup``.

Each row runs a generated main script in a fresh interpreter, as a user's training script runs:
imports at its top, ``source`` and ``step`` defined in it (the tiny workload: 8 samples of 4x4
uint8 and a cast), and under ``if __name__ == "__main__":`` three loaders in a row with W=2 (a
training loader, then validation, then a reload). Columns: the seconds the script spent importing
before it made its first Loader; the first loader's seconds from ``Loader(...)`` to its first
batch ("ready": until every worker said hello; "trace": the slowest worker's first traced step);
the later loaders' (median); and the milliseconds from an epoch's last batch to the next epoch's
first. The ``in-process`` rows are the reference: the same script traces the same source and step
with DALI in its own process, from the end of its imports to the first batch (DALI's own first
traced batch, its source analysis included).

Main scripts (``--scripts``):

- ``dali``: ``import torch`` and ``import nvidia.dali.experimental.dynamic`` at the top, then
  ``from loader import ...`` (the README's order), the Loader right after the imports;
- ``heavy``: the same plus ``import pytorch_lightning`` (torch + Lightning + DALI: the >= 2 s of
  imports a real training script has);
- ``early``: the heavy imports in isort's order (``pytorch_lightning``, ``loader``, ``nvidia``,
  ``torch``) with ``loader.processes.server.start_early()`` called right after ``import loader``:
  what the
  loader package would do at the end of its own import (the server forked then, its DALI import
  and source analysis overlapping the script's later imports).

Start methods (``--methods``): ``default`` (no setting at all: the worker server, forked from the
trainer where safe), ``exec`` (the server as a fresh interpreter, ``DALI_LOADER_SERVER=exec``),
``spawn`` (``DALI_LOADER_START_METHOD=spawn``) and ``in-process``. ``--repeats N`` runs every row
N times, alternating the rows, and prints medians.

Targets (issue 35): default settings, the first loader <= 1.0 s after ``Loader(...)`` when the
script spent >= 2 s importing, and <= 3x the in-process first traced batch when the Loader comes
right after the imports; later loaders <= 0.2 s.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

from bench import _harness as H

ROOT = Path(__file__).resolve().parents[1]

IMPORTS = {
    "dali": """
        import torch
        import nvidia.dali.experimental.dynamic as ndd
        from loader import Loader
        """,
    "heavy": """
        import torch
        import pytorch_lightning
        import nvidia.dali.experimental.dynamic as ndd
        from loader import Loader
        """,
    "early": """
        import pytorch_lightning
        from loader import Loader
        from loader.processes import server as _server
        _server.start_early()
        import nvidia.dali.experimental.dynamic as ndd
        import torch
        """,
}

SCRIPT = """
import time

STARTED = time.perf_counter()
import sys

sys.path.insert(0, {root!r})
{imports}
import json

import numpy as np

IMPORTED = time.perf_counter()
BATCH = 8


class Batches:
    def __init__(self, count):
        self.count = count
        self.samples = [np.full((4, 4), i, dtype=np.uint8) for i in range(BATCH)]

    def __iter__(self):
        for _ in range(self.count):
            yield ndd.batch(self.samples)


def source(shard):
    return ndd.ExternalSource(Batches(200 // shard.count), cycle="raise")


def step(batch):
    return {{"x": ndd.cast(batch, dtype=ndd.uint8)}}


def loaders(count=3):
    from loader.processes import server as _server

    first, boundary, ready, trace = [], [], [], []
    for _ in range(count):
        started = last = time.perf_counter()
        with Loader(source, step, batch_size=BATCH, num_workers=2) as loader:
            for epoch in range(3):
                batches = iter(loader)
                batch = next(batches)
                now = time.perf_counter()
                if epoch == 0:
                    first.append(now - started)
                    stats = loader.stats()
                    ready.append(stats.startup_seconds)
                    trace.append(max(w.trace_seconds[0] for w in stats.workers))
                else:
                    boundary.append(1000 * (now - last))
                del batch
                for batch in batches:
                    del batch
                last = time.perf_counter()
    return {{"first": first, "boundary": boundary, "ready": ready, "trace": trace,
             "server": _server.started_how() or "-"}}


def in_process():
    import workers

    started = time.perf_counter()
    ctx = workers.make_context(2, None)
    shard = workers.Shard(0, 1, 0, 1, 0, 1, 0)
    inputs = next(iter(workers.epoch_iterator(source(shard), BATCH, ctx, True)))
    {{k: ndd.as_tensor(v).evaluate() for k, v in step(inputs).items()}}
    first = time.perf_counter() - started
    return {{"first": [first, first], "boundary": [0.0], "ready": [0.0], "trace": [0.0],
             "server": "-"}}


if __name__ == "__main__":
    found = in_process() if sys.argv[1] == "in-process" else loaders()
    found["imports"] = IMPORTED - STARTED
    print(json.dumps(found))
"""

#: start method -> (environment, the server expected)
METHODS: dict[str, tuple[dict[str, str], set[str]]] = {
    "in-process": ({}, {"-"}),
    "default": ({}, {"fork", "exec"}),
    "exec": ({"DALI_LOADER_SERVER": "exec"}, {"exec"}),
    "spawn": ({"DALI_LOADER_START_METHOD": "spawn"}, {"-"}),
}


def run_row(directory: Path, script_kind: str, method: str) -> dict[str, Any]:
    script = directory / f"main_{script_kind}.py"
    if not script.exists():
        imports = textwrap.dedent(IMPORTS[script_kind])
        script.write_text(SCRIPT.format(imports=imports, root=str(ROOT)))
    extra, servers = METHODS[method]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DALI_LOADER_")}
    env.update(extra)
    done = subprocess.run(
        [sys.executable, str(script), method],
        capture_output=True,
        text=True,
        env=env,
        cwd=directory,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{script.name} {method} failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    if result["server"] not in servers:
        raise RuntimeError(f"{script.name} {method}: server {result['server']}, not {servers}")
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--scripts", default="dali,heavy,early")
    parser.add_argument("--methods", default="in-process,default,exec,spawn")


def parser() -> argparse.ArgumentParser:
    return H.parser("startup", __doc__, add_arguments)


Row = tuple[str, str]


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    rows = [
        (script, method)
        for script in args.scripts.split(",")
        for method in args.methods.split(",")
        if not (script == "early" and method != "default")
    ]
    columns = ("imports", "first", "later", "ready", "trace", "boundary")
    results: dict[Row, dict[str, list[float]]] = {row: {c: [] for c in columns} for row in rows}
    servers: dict[Row, set[str]] = {row: set() for row in rows}
    with tempfile.TemporaryDirectory() as folder:
        found = H.paired(
            {"/".join(row): functools.partial(run_row, Path(folder), *row) for row in rows},
            rounds=args.repeats,
            order="fixed",
        )
    for row, runs in zip(rows, found.values(), strict=True):
        for run in runs:
            values, got = results[row], run.value
            values["imports"].append(got["imports"])
            values["first"].append(got["first"][0])
            values["later"].append(statistics.median(got["first"][1:]))
            values["ready"].append(got["ready"][0])
            values["trace"].append(got["trace"][0])
            values["boundary"].append(statistics.median(got["boundary"]))
            servers[row].add(got["server"])
    render(results, servers, args.repeats)


COLUMNS = [
    H.Col("script", left=True),
    H.Col("imports s", ".2f"),
    H.Col("start method", left=True),
    H.Col("server", left=True),
    H.Col("1st loader s", ".2f"),
    H.Col("(ready", ".2f"),
    H.Col("trace)", ".2f"),
    H.Col("vs in-proc"),
    H.Col("later s", ".2f"),
    H.Col("boundary ms", ".1f"),
]


def render(
    results: dict[Row, dict[str, list[float]]], servers: dict[Row, set[str]], repeats: int
) -> None:
    rows = []
    for (script, method), values in results.items():
        med = {c: statistics.median(v) for c, v in values.items()}
        reference = results.get((script, "in-process"))
        if script == "early":
            reference = results.get(("heavy", "in-process"))
        base = statistics.median(reference["first"]) if reference else None
        ratio = H.ratio(med["first"], base, ".1f") if method != "in-process" else "-"
        server = "/".join(sorted(servers[(script, method)]))
        rows.append(
            (
                script,
                med["imports"],
                method,
                server,
                med["first"],
                med["ready"],
                med["trace"],
                ratio,
                med["later"],
                med["boundary"],
            )
        )
    H.print_table(COLUMNS, rows)
    print(
        f"medians of {repeats} run(s) per row, rows alternated; targets (default settings): "
        "1st loader <= 1.0 s after >= 2 s of imports, <= 3x in-process; later loaders <= 0.2 s"
    )


if __name__ == "__main__":
    main()
