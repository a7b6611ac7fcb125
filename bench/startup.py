"""Startup and epoch boundaries, side by side in one run: ``python -m bench.startup``.

The tiny workload with W=2, three loaders in a row in one process (as a test suite builds
them): seconds from ``Loader(...)`` to the first batch, and milliseconds from the last batch of
epoch e to the first batch of epoch e+1, for ``start_method="spawn"`` (each worker imports DALI
and the main script) and ``"forkserver"`` (one worker server per process imports DALI and the
main module once and forks the workers; ``loader._server``), the server forked from the trainer
(``fork``) or a fresh interpreter (``exec``, ``DALI_LOADER_SERVER=exec``).

Each row runs a generated main script in a fresh interpreter, as a user's training script runs:
a plain one, and a real one with ``import torch`` and ``import numpy`` at its top (a spawned
worker imports the main module, so such a script makes every worker import torch).
``--repeats N`` runs every row N times, alternating the rows, and prints medians;
``--no-defer`` turns the worker's torch deferral off (``DALI_LOADER_DEFER_TORCH=0``).

"ready s" is the first loader's construction until every worker said hello (the server's start
and the workers' start), "trace s" the slowest worker's first traced step. The ``in-process``
rows are the reference: DALI imported and the same source and step traced in the main process,
from the import to the first batch (what a loader's first batch cannot beat without starting
earlier: its workers or their server import DALI and trace the same way).
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

SCRIPT = textwrap.dedent(
    """
    {torch_import}
    import functools
    import json
    import sys
    import time

    sys.path.insert(0, {root!r})

    from bench import _sources as S
    from loader import Loader


    def main(start_method, loaders=3):
        source = functools.partial(S.tiny_source, batches=200)
        first, boundary, ready, trace = [], [], [], []
        for _ in range(loaders):
            started = last = time.perf_counter()
            with Loader(
                source, S.tiny_step, batch_size=S.TINY_BATCH, num_workers=2,
                start_method=start_method,
            ) as loader:
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
        from loader import _server

        print(json.dumps({{
            "first": first, "boundary": boundary, "ready": ready, "trace": trace,
            "server": _server.started_how() or "-",
        }}))


    def in_process():
        # the reference: DALI in this process, from its import to the first traced batch
        started = time.perf_counter()
        import nvidia.dali.experimental.dynamic as ndd

        import workers

        ctx = workers.make_context(2, None)
        source = S.tiny_source(workers.Shard(0, 1, 0, 1, 0, 1, 0), batches=200)
        inputs = next(iter(workers.epoch_iterator(source, S.TINY_BATCH, ctx, True)))
        {{k: ndd.as_tensor(v).evaluate() for k, v in S.tiny_step(inputs).items()}}
        first = time.perf_counter() - started
        print(json.dumps({{"first": [first, first], "boundary": [0.0], "ready": [0.0],
                          "trace": [0.0], "server": "-"}}))


    if __name__ == "__main__":
        in_process() if sys.argv[1] == "in-process" else main(sys.argv[1])
    """
)

#: (start method, main script, how the worker server starts)
ROWS = [
    ("in-process", "plain", "-"),
    ("in-process", "torch", "-"),
    ("spawn", "plain", "-"),
    ("spawn", "torch", "-"),
    ("forkserver", "plain", "fork"),
    ("forkserver", "torch", "fork"),
    ("forkserver", "plain", "exec"),
    ("forkserver", "torch", "exec"),
]
MAINS = {"plain": "", "torch": "import torch\nimport numpy"}


def run_row(
    directory: Path, method: str, main: str, server: str, defer: bool = True
) -> dict[str, Any]:
    script = directory / f"main_{main}.py"
    if not script.exists():
        script.write_text(SCRIPT.format(torch_import=MAINS[main], root=str(ROOT)))
    env = dict(os.environ, DALI_LOADER_DEFER_TORCH="1" if defer else "0")
    env.pop("DALI_LOADER_SERVER", None)
    if server != "-":
        env["DALI_LOADER_SERVER"] = server
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
    if result["server"] != server:
        raise RuntimeError(f"{script.name} {method}: server {result['server']}, not {server}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--no-defer", action="store_true", help="DALI_LOADER_DEFER_TORCH=0")
    args = parser.parse_args()
    columns = ("first", "later", "ready", "trace", "boundary")
    results = {row: {c: [] for c in columns} for row in ROWS}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.repeats):
            for row in ROWS:
                found = run_row(Path(folder), *row, defer=not args.no_defer)
                values = results[row]
                values["first"].append(found["first"][0])
                values["later"].append(statistics.median(found["first"][1:]))
                values["ready"].append(found["ready"][0])
                values["trace"].append(found["trace"][0])
                values["boundary"].append(statistics.median(found["boundary"]))
    print(
        f"{'start method':<13} {'main imports':<14} {'server':<7} {'1st loader s':>12} "
        f"{'(ready s':>9} {'trace s)':>9} {'later loaders s':>16} {'epoch boundary ms':>18}"
    )
    for (method, main_kind, server), values in results.items():
        med = {c: statistics.median(v) for c, v in values.items()}
        print(
            f"{method:<13} {'torch, numpy' if main_kind == 'torch' else '-':<14} {server:<7} "
            f"{med['first']:>12.2f} {med['ready']:>9.2f} {med['trace']:>9.2f} "
            f"{med['later']:>16.2f} {med['boundary']:>18.1f}"
        )
    print(
        f"medians of {args.repeats} run(s) per row; targets (tiny, W=2, whatever the main "
        "module imports): first loader <= 1.5 s, later loaders <= 0.7 s"
    )


if __name__ == "__main__":
    main()
