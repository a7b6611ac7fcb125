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
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--scripts", default="dali,heavy,early")
    parser.add_argument("--methods", default="in-process,default,exec,spawn")
    args = parser.parse_args()
    rows = [
        (script, method)
        for script in args.scripts.split(",")
        for method in args.methods.split(",")
        if not (script == "early" and method != "default")
    ]
    columns = ("imports", "first", "later", "ready", "trace", "boundary")
    results: dict[tuple[str, str], dict[str, list[float]]] = {
        row: {c: [] for c in columns} for row in rows
    }
    servers: dict[tuple[str, str], set[str]] = {row: set() for row in rows}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.repeats):
            for row in rows:
                found = run_row(Path(folder), *row)
                values = results[row]
                values["imports"].append(found["imports"])
                values["first"].append(found["first"][0])
                values["later"].append(statistics.median(found["first"][1:]))
                values["ready"].append(found["ready"][0])
                values["trace"].append(found["trace"][0])
                values["boundary"].append(statistics.median(found["boundary"]))
                servers[row].add(found["server"])
    print_table(results, servers, args.repeats)


def print_table(
    results: dict[tuple[str, str], dict[str, list[float]]],
    servers: dict[tuple[str, str], set[str]],
    repeats: int,
) -> None:
    print(
        f"{'script':<7} {'imports s':>9} {'start method':<12} {'server':<6} "
        f"{'1st loader s':>12} {'(ready':>7} {'trace)':>7} {'vs in-proc':>10} "
        f"{'later s':>8} {'boundary ms':>11}"
    )
    for (script, method), values in results.items():
        med = {c: statistics.median(v) for c, v in values.items()}
        reference = results.get((script, "in-process"))
        if script == "early":
            reference = results.get(("heavy", "in-process"))
        ratio = "-"
        if reference and method != "in-process":
            ratio = f"{med['first'] / statistics.median(reference['first']):.1f}x"
        print(
            f"{script:<7} {med['imports']:>9.2f} {method:<12} "
            f"{'/'.join(sorted(servers[(script, method)])):<6} {med['first']:>12.2f} "
            f"{med['ready']:>7.2f} {med['trace']:>7.2f} {ratio:>10} {med['later']:>8.2f} "
            f"{med['boundary']:>11.1f}"
        )
    print(
        f"medians of {repeats} run(s) per row, rows alternated; targets (default settings): "
        "1st loader <= 1.0 s after >= 2 s of imports, <= 3x in-process; later loaders <= 0.2 s"
    )


if __name__ == "__main__":
    main()
