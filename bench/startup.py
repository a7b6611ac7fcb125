"""Startup and epoch boundaries, side by side in one run: ``python -m bench.startup``.

The tiny workload with W=2, three loaders in a row in one process (as a test suite builds
them): seconds from ``Loader(...)`` to the first batch, and milliseconds from the last batch of
epoch e to the first batch of epoch e+1, for ``start_method="spawn"`` (each worker imports DALI
and the main script) and ``"forkserver"`` (the server imports DALI once; workers are forked from
it).

Each row runs a generated main script in a fresh interpreter, as a user's training script runs:
with and without ``import torch`` at its top (a worker imports the main module, so a script that
imports torch makes every worker import it), and with the worker's torch deferral on and off
(``DALI_LOADER_DEFER_TORCH=0``). ``--repeats N`` runs every row N times, alternating the rows,
and prints medians.
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
        first, boundary = [], []
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
                    else:
                        boundary.append(1000 * (now - last))
                    del batch
                    for batch in batches:
                        del batch
                    last = time.perf_counter()
        print(json.dumps({{"first": first, "boundary": boundary}}))


    if __name__ == "__main__":
        main(sys.argv[1])
    """
)

ROWS = [
    (method, torch, defer)
    for method in ("spawn", "forkserver")
    for torch in (False, True)
    for defer in (True, False)
]


def run_row(directory: Path, method: str, torch: bool, defer: bool) -> dict[str, list[float]]:
    script = directory / ("main_torch.py" if torch else "main_plain.py")
    if not script.exists():
        script.write_text(
            SCRIPT.format(torch_import="import torch" if torch else "", root=str(ROOT))
        )
    env = dict(os.environ, DALI_LOADER_DEFER_TORCH="1" if defer else "0")
    done = subprocess.run(
        [sys.executable, str(script), method],
        capture_output=True,
        text=True,
        env=env,
        cwd=directory,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{script.name} {method} failed:\n{done.stderr[-3000:]}")
    result: dict[str, list[float]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    results: dict[tuple[str, bool, bool], dict[str, list[float]]] = {
        row: {"first": [], "later": [], "boundary": []} for row in ROWS
    }
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.repeats):
            for row in ROWS:
                found = run_row(Path(folder), *row)
                results[row]["first"].append(found["first"][0])
                results[row]["later"].append(statistics.median(found["first"][1:]))
                results[row]["boundary"].append(statistics.median(found["boundary"]))
    print(
        f"{'start method':<13} {'main imports':<13} {'deferral':<9} {'1st loader s':>12} "
        f"{'later loaders s':>16} {'epoch boundary ms':>18}"
    )
    for (method, torch, defer), values in results.items():
        print(
            f"{method:<13} {'torch' if torch else '-':<13} {'on' if defer else 'off':<9} "
            f"{statistics.median(values['first']):>12.2f} "
            f"{statistics.median(values['later']):>16.2f} "
            f"{statistics.median(values['boundary']):>18.1f}"
        )
    print(f"medians of {args.repeats} run(s) per row; target: first batch <= 1.0 s (tiny, W=2)")


if __name__ == "__main__":
    main()
