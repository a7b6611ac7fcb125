"""A test suite of small loaders under ``pytest -n 2``: ``python -m bench.suite``.

Writes 12 small tests into a temporary folder (4 files; each test builds a Loader with W=2 over
the tiny workload, 8 samples of 4x4 uint8 and a cast, runs one epoch of 16 batches and checks the
count, leak-checked by the plugin's ``leak_check``) and runs them with ``pytest -n 2`` in four
ways, alternated, reporting each run's wall time:

- ``default``: no setting at all: the ``loader.testing`` plugin starts one worker server per
  xdist worker before its first test (the suite uses DALI), with the suite's DALI-calling files
  parsed in it, and every Loader forks its workers from it;
- ``no-plugin``: ``--no-loader-worker-server``: the first Loader of each xdist worker starts the
  server (a fresh interpreter, since a fork inside a test would carry that test's state);
- ``spawn``: ``DALI_LOADER_START_METHOD=spawn``, every loader's workers spawned (the default
  before round 4);
- ``in-process``: the same tests running the same source and step with DALI in the test process
  (capture mode, the worker's own epoch loop), no Loader.

Target (issue 35): the default suite within 1.2x the in-process suite's wall time.
``--repeats N`` runs every way N times (medians); ``--tests N`` changes the number of tests.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from bench import _harness as H

ROOT = Path(__file__).resolve().parents[1]

STEPS = """
import numpy as np
import nvidia.dali.experimental.dynamic as ndd

BATCHES = 16
BATCH = 8


class Batches:
    def __init__(self, count):
        self.count = count
        self.samples = [np.full((4, 4), i, dtype=np.uint8) for i in range(BATCH)]

    def __iter__(self):
        for _ in range(self.count):
            yield ndd.batch(self.samples)


def source(shard):
    return ndd.ExternalSource(Batches(BATCHES // shard.count), cycle="raise")


def step(batch):
    return {"x": ndd.cast(batch, dtype=ndd.uint8)}
"""

LOADER_TESTS = """
import pytest
from loader import Loader

import steps


@pytest.mark.parametrize("n", range({count}))
def test_one_epoch(leak_check, n):
    with Loader(steps.source, steps.step, batch_size=steps.BATCH, num_workers=2) as loader:
        assert sum(1 for batch in loader) == steps.BATCHES
"""

IN_PROCESS_TESTS = """
import pytest
import nvidia.dali.experimental.dynamic as ndd

import workers
from workers import Shard

import steps


@pytest.mark.parametrize("n", range({count}))
def test_one_epoch(leak_check, n):
    ctx = workers.make_context(2, None)
    source = steps.source(Shard(0, 1, 0, 1, 0, 1, 0))
    count = 0
    for inputs in workers.epoch_iterator(source, steps.BATCH, ctx, True):
        out = steps.step(inputs)
        {{key: ndd.as_tensor(value).evaluate() for key, value in out.items()}}
        count += 1
    assert count == steps.BATCHES
"""

CONFTEST = f"""
import sys

sys.path.insert(0, {str(ROOT)!r})
"""

#: way -> (test kind, extra pytest arguments, extra environment)
WAYS: dict[str, tuple[str, list[str], dict[str, str]]] = {
    "default": ("loader", [], {}),
    "no-plugin": ("loader", ["--no-loader-worker-server"], {}),
    "spawn": ("loader", [], {"DALI_LOADER_START_METHOD": "spawn"}),
    "in-process": ("in_process", [], {}),
}


def write_suite(folder: Path, tests: int, files: int = 4) -> None:
    for kind, template in (("loader", LOADER_TESTS), ("in_process", IN_PROCESS_TESTS)):
        suite = folder / kind
        suite.mkdir()
        (suite / "conftest.py").write_text(CONFTEST)
        (suite / "steps.py").write_text(STEPS)
        for index in range(files):
            count = tests // files + (1 if index < tests % files else 0)
            text = textwrap.dedent(template).format(count=count)
            (suite / f"test_suite_{index}.py").write_text(text)


def run_way(folder: Path, way: str) -> None:
    kind, arguments, extra = WAYS[way]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DALI_LOADER_")}
    env.update(extra)
    command = [sys.executable, "-m", "pytest", "-n", "2", "-q", "-p", "no:cacheprovider"]
    done = subprocess.run(
        [*command, *arguments, str(folder / kind)],
        capture_output=True,
        text=True,
        env=env,
        cwd=folder / kind,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{way}: pytest failed:\n{done.stdout[-3000:]}\n{done.stderr[-2000:]}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--tests", type=int, default=12)
    parser.add_argument("--ways", default=",".join(WAYS), help="comma-separated, of " + str(WAYS))


def parser() -> argparse.ArgumentParser:
    return H.parser("suite", __doc__, add_arguments)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    ways = args.ways.split(",")
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        write_suite(folder, args.tests)
        found = H.paired(
            {way: functools.partial(run_way, folder, way) for way in ways},
            rounds=args.repeats,
            order="fixed",
        )
    walls = {way: [t.wall for t in runs] for way, runs in found.items()}
    base = statistics.median(walls["in-process"]) if "in-process" in walls else None
    print(f"{args.tests} tests, pytest -n 2, tiny workload, W=2, one epoch each")
    H.print_table(
        [H.Col("way", left=True), H.Col("wall s", ".1f"), H.Col("runs"), H.Col("vs in-process")],
        [
            (
                way,
                statistics.median(values),
                H.runs(values, ".1f"),
                H.ratio(statistics.median(values), base),
            )
            for way, values in walls.items()
        ],
    )
    if base and "default" in walls:
        ratio = statistics.median(walls["default"]) / base
        verdict = "met" if ratio <= 1.2 else "MISSED"
        print(f"default / in-process <= 1.2: {ratio:.2f} {verdict}")


if __name__ == "__main__":
    main()
