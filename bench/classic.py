"""The loader next to DALI's classic pipeline through its PyTorch plugin:
``python -m bench.classic [--pairs N]``.

The classic contender is what DALI users run today: ``pipeline_def`` with ``fn.readers.file``
(images) or ``fn.external_source(parallel=True)`` (python workload), the same operators as the
loader's step, iterated by ``nvidia.dali.plugin.pytorch.DALIGenericIterator`` with
``LastBatchPolicy.PARTIAL`` (and ``reader_name`` for the reader), in one process with all the
threads (``num_threads`` = the total thread budget, as in-process capture gets). ``bench.run``
takes its epochs from here.

Run as a module it measures the images workload (decode, random resized crop 224, flip,
normalize; batches of 64; the 512 sample images): the loader with W=2 workers (capture, one
thread each) against the classic pipeline with 2 threads, as alternated pairs (which one goes
first alternates too), and prints every pair's ratio and their median. Per run: batches/s over the
timed epochs, the CPU of every process the contender runs (the loader: trainer and workers; the
classic pipeline: its one process) per batch, and the first batch of the run (from building it).
When both keep every core busy, the throughput ratio tends to the inverse ratio of their CPU per
batch, which a loaded machine disturbs less; both are printed.

``--phases THREADS`` measures instead where a batch's CPU goes, in this one process with THREADS
DALI threads: the classic pipeline with and without its plugin next to the worker's own capture
loop, and that loop's parts (epoch iterator, step call, evaluation, the copy into a slot).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import psutil

from bench import _harness as H
from bench import _sources as S
from loader import Loader, ensure_sample_dataset, list_images
from loader.sample import image_source, image_step

BATCH = 64
WORKERS = 2
READER = "Reader"
MEAN = [0.485 * 255, 0.456 * 255, 0.406 * 255]
STD = [0.229 * 255, 0.224 * 255, 0.225 * 255]


def images_pipeline(root: str, batch_size: int, threads: int, seed: int = 0) -> Any:
    """``image_step`` as a classic pipeline over ``fn.readers.file`` (shuffled, one shard)."""
    from nvidia.dali import fn, pipeline_def, types

    files, labels = list_images(root)

    @pipeline_def(batch_size=batch_size, num_threads=threads, device_id=None, seed=seed)
    def images() -> Any:
        jpegs, label = fn.readers.file(
            files=files, labels=labels, random_shuffle=True, name=READER, pad_last_batch=True
        )
        decoded = fn.decoders.image(jpegs, device="cpu")
        cropped = fn.random_resized_crop(decoded, size=[224, 224])
        flip = fn.random.coin_flip(probability=0.5)
        image = fn.crop_mirror_normalize(
            cropped, dtype=types.FLOAT, mirror=flip, mean=MEAN, std=STD
        )
        return image, label

    return images()


def python_pipeline(batches: int, workers: int, threads: int) -> Any:
    """``light_step`` over ``python_work`` batches from ``workers`` DALI Python workers."""
    from nvidia.dali import fn, pipeline_def

    @pipeline_def(
        batch_size=S.PY_BATCH,
        num_threads=threads,
        device_id=None,
        py_num_workers=workers,
        py_start_method="spawn",
    )
    def python() -> Any:
        data = fn.external_source(
            source=S.ParallelCallback(batches), parallel=True, batch=True, batch_info=True
        )
        return fn.normalize(data, axes=[0])

    return python()


def plugin_epochs(pipeline: Any, outputs: list[str], reader: str | None) -> Iterator[Iterable[Any]]:
    """Epochs of ``DALIGenericIterator`` over ``pipeline`` (built here; the iterator runs the
    first batch when made, as users' code does)."""
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    pipeline.build()
    iterator = DALIGenericIterator(
        pipeline,
        outputs,
        reader_name=reader,
        last_batch_policy=LastBatchPolicy.PARTIAL,
        auto_reset=True,
    )
    while True:
        yield iterator


def images_epochs(root: str, batch_size: int, threads: int) -> Iterator[Iterable[Any]]:
    return plugin_epochs(images_pipeline(root, batch_size, threads), ["image", "label"], READER)


def python_epochs(batches: int, workers: int, threads: int) -> Iterator[Iterable[Any]]:
    return plugin_epochs(python_pipeline(batches, workers, threads), ["x"], None)


# ------------------------------------------------------------------------------- pairs
@dataclass
class Run:
    batches_per_second: float
    cpu_ms: float  # per batch, every process of the contender, all threads
    first_batch_s: float  # from building the contender to its first batch


def _timed(epochs: Iterator[Iterable[Any]], count: int, processes: Any) -> Run:
    """The first epoch is a warm-up (it traces; its first batch is the start), then ``count``
    timed epochs. ``processes()`` lists the processes whose CPU counts, once warm."""
    first = 0.0
    with H.Clock() as start:
        for batch in next(epochs):
            if not first:
                first = start.lap()
            del batch
    watched = processes()
    cpu = H.process_cpu(watched)
    batches = 0
    with H.Clock() as clock:
        for _ in range(count):
            for batch in next(epochs):
                batches += 1
                del batch
    return Run(batches / clock.wall, 1e3 * (H.process_cpu(watched) - cpu) / batches, first)


def measure_loader(root: str, epochs: int, threads: int) -> Run:
    source = functools.partial(image_source, root=root, batch_size=BATCH)
    with Loader(
        source,
        image_step,
        batch_size=BATCH,
        num_workers=WORKERS,
        num_threads=max(1, threads // WORKERS),
    ) as loader:

        def forever() -> Iterator[Iterable[Any]]:
            while True:
                yield loader

        def processes() -> list[psutil.Process]:
            return [psutil.Process()] + [psutil.Process(p) for p in loader.worker_pids()]

        return _timed(forever(), epochs, processes)


def measure_classic(root: str, epochs: int, threads: int) -> Run:
    iterator = images_epochs(root, BATCH, threads)
    try:
        return _timed(iterator, epochs, lambda: [psutil.Process()])
    finally:
        iterator.close()


# ------------------------------------------------------------------------------- phases
def _epoch_cost(epochs: Iterator[Iterable[Any]]) -> tuple[float, float]:
    """CPU (this process, every thread) and wall ms per batch of the next epoch."""
    count = 0
    with H.Clock() as clock:
        for batch in next(epochs):
            count += 1
            del batch
    return 1e3 * clock.cpu / count, 1e3 * clock.wall / count


def _classic_run(root: str, threads: int, per_epoch: int) -> Iterator[Iterable[Any]]:
    pipeline = images_pipeline(root, BATCH, threads)
    pipeline.build()

    def epoch() -> Iterator[Any]:
        for _ in range(per_epoch):
            yield pipeline.run()

    while True:
        yield epoch()


class _Phases:
    """Wall and main-thread CPU ns of the named parts of a batch, summed."""

    def __init__(self) -> None:
        self.wall: dict[str, int] = {}
        self.cpu: dict[str, int] = {}
        self._mark = (0, 0)

    def start(self) -> None:
        self._mark = (time.perf_counter_ns(), time.thread_time_ns())

    def lap(self, name: str) -> None:
        wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
        self.wall[name] = self.wall.get(name, 0) + wall - self._mark[0]
        self.cpu[name] = self.cpu.get(name, 0) + cpu - self._mark[1]
        self._mark = (wall, cpu)


def _dynamic(root: str, threads: int, parts: _Phases) -> Iterator[Iterable[Any]]:
    """The worker's own batch loop without its process and transport: the capture-mode epoch
    iterator of the reader, ``image_step``, evaluation and the packed copy into a slot-sized
    buffer (as ``Publisher.publish`` does), each part timed into ``parts``."""
    import ctypes

    import numpy as np

    import workers
    from loader import Shard

    ctx = workers.make_context(threads, None)
    source = image_source(
        Shard.make(rank=0, world_size=1, worker=0, num_workers=1, seed=0), root, BATCH
    )
    slot = np.ones(BATCH * (3 * 224 * 224 * 4 + 64), dtype=np.uint8)  # touched: reused pages

    def epoch() -> Iterator[Any]:
        iterator = workers.epoch_iterator(source, BATCH, ctx, True)
        while True:
            parts.start()
            try:
                jpegs, labels = next(iterator)
            except StopIteration:
                return
            parts.lap("next(epoch iterator)")
            out = image_step(jpegs, labels)
            parts.lap("step() call")
            storages = [batch.evaluate()._storage for batch in out.values()]
            parts.lap("evaluate()")
            offset = 0
            for storage in storages:
                storage.copy_to_external(ctypes.c_void_p(slot.ctypes.data + offset))
                offset += 3 * 224 * 224 * 4 * BATCH
            parts.lap("copy into slot")
            yield out

    while True:
        yield epoch()


def phases(
    root: str, rounds: int, threads: int
) -> tuple[list[tuple[str, list[float], list[float]]], _Phases, int]:
    """Per-batch CPU and wall ms of the images workload in this one process with ``threads``
    DALI threads: the classic pipeline with and without its plugin next to what a loader worker
    does (``threads=1``). Every variant is built and run for an epoch first; then each round
    runs two epochs of each (the order alternates) and times the second (the first takes what a
    variant computed ahead while the others ran). Returns the per-round values, the parts of
    the worker's loop over the timed epochs and how many batches those were."""
    per_epoch = len(list_images(root)[0]) // BATCH
    parts = _Phases()
    variants: dict[str, Callable[[], Iterator[Iterable[Any]]]] = {
        "classic pipeline.run()": functools.partial(_classic_run, root, threads, per_epoch),
        "classic + plugin": functools.partial(images_epochs, root, BATCH, threads),
        "worker loop (capture)": functools.partial(_dynamic, root, threads, parts),
    }
    running = {name: make() for name, make in variants.items()}
    for epochs in running.values():
        _epoch_cost(epochs)  # build, trace
    timed = _Phases()

    def second_epoch(epochs: Iterator[Iterable[Any]]) -> tuple[float, float]:
        _epoch_cost(epochs)
        before = (dict(parts.wall), dict(parts.cpu))
        cost = _epoch_cost(epochs)
        for part in parts.wall:
            timed.wall[part] = timed.wall.get(part, 0) + parts.wall[part] - before[0].get(part, 0)
            timed.cpu[part] = timed.cpu.get(part, 0) + parts.cpu[part] - before[1].get(part, 0)
        return cost

    found = H.paired(
        {name: functools.partial(second_epoch, epochs) for name, epochs in running.items()},
        rounds=rounds,
    )
    for epochs in running.values():
        epochs.close()  # type: ignore[attr-defined]
    rows = [
        (name, [t.value[0] for t in made], [t.value[1] for t in made])
        for name, made in found.items()
    ]
    return rows, timed, rounds * per_epoch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pairs", type=int, default=8, help="alternated loader/classic pairs")
    parser.add_argument("--epochs", type=int, default=8, help="timed epochs per run")
    H.add_threads(parser)
    parser.add_argument(
        "--phases",
        type=int,
        default=None,
        metavar="THREADS",
        help="instead: per-batch CPU of the parts of a batch in one process with THREADS threads",
    )


def parser() -> argparse.ArgumentParser:
    return H.parser("classic", __doc__, add_arguments)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    threads = H.threads(args.threads)
    root = str(ensure_sample_dataset())
    print(f"load average at start: {H.load_average()}")
    if args.phases is not None:
        print_phases(root, args.epochs, args.phases)
    else:
        print_pairs(root, args.pairs, args.epochs, threads)
    print(f"load average at end: {H.load_average()}")


def print_phases(root: str, epochs: int, threads: int) -> None:
    rows, parts, batches = phases(root, epochs, threads)
    H.print_table(
        [
            H.Col(f"one process, {threads} thread(s)", left=True),
            H.Col("CPU ms/batch (range)"),
            H.Col("wall ms/batch (range)"),
        ],
        [(name, H.spread(cpu), H.spread(wall)) for name, cpu, wall in rows],
    )
    H.print_table(
        [
            H.Col("worker loop, by part", left=True),
            H.Col("main thread CPU ms", ".2f"),
            H.Col("wall ms/batch", ".2f"),
        ],
        [
            (f"  {part}", parts.cpu[part] / 1e6 / batches, spent / 1e6 / batches)
            for part, spent in parts.wall.items()
        ],
    )


def print_pairs(root: str, pairs: int, epochs: int, threads: int) -> None:
    found = H.paired(
        {
            "loader W=2": functools.partial(measure_loader, root, epochs, threads),
            "classic+plugin": functools.partial(measure_classic, root, epochs, threads),
        },
        rounds=pairs,
    )
    H.print_table(
        [
            H.Col("pair"),
            H.Col("contender", left=True),
            H.Col("batches/s", ".2f"),
            H.Col("CPU ms/batch", ".1f"),
            H.Col("1st batch s", ".2f"),
        ],
        [
            (t.round, name, t.value.batches_per_second, t.value.cpu_ms, t.value.first_batch_s)
            for name, t in H.in_order(found)
        ],
    )
    ratios = H.ratios(found, "loader W=2", "classic+plugin", lambda run: run.batches_per_second)
    H.print_ratios("loader / classic+plugin", ratios, 0.97)
    cpu = {name: [t.value.cpu_ms for t in made] for name, made in found.items()}
    loader_cpu, classic_cpu = (statistics.median(values) for values in cpu.values())
    print(
        f"CPU ms per batch, median (range): loader W=2 {H.spread(cpu['loader W=2'])}, "
        f"classic+plugin {H.spread(cpu['classic+plugin'])}; classic / loader "
        f"{classic_cpu / loader_cpu:.3f} (the throughput ratio when both keep every core busy)"
    )


if __name__ == "__main__":
    main()
