"""Side-by-side benchmarks: ``python -m bench`` (``--quick`` for a short run).

Workloads (same data for every contender, in one run):

* ``images``: JPEG files -> decode -> random resized crop 224 -> flip -> normalize, batch 64;
* ``python``: an ExternalSource whose Python callback does ~5 ms of numpy work per batch, then a
  light DALI op (one process is GIL-bound here);
* ``tiny``: 8 samples of 4x4 uint8 per batch, trivial body: the per-batch overhead.

Contenders: in-process DALI capture and eager (same total threads); torch DataLoader with W
workers each running the same DALI body eagerly; DALI's classic pipeline through its PyTorch
plugin (``DALIGenericIterator``; ``fn.readers.file`` in one process with the same total threads
for images, ``fn.external_source(parallel=True)`` with W Python workers for the python workload;
see ``bench/classic.py``); this loader with W workers, capture on and off. Each contender runs
``repeats + 1`` epochs; the first is a warm-up (its start gives the time to the first batch) and
the median of the others gives the throughput. The trainer's CPU time per 1,000 batches (the CPU
time of the whole benchmark process, every thread) is measured over the timed epochs. Results go
to ``bench/results/latest.json`` and a plot to ``bench/results/throughput.png``.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench import _harness as H
from bench import _sources as S
from bench import classic
from loader import Loader, ensure_sample_dataset, list_images
from loader.sample import image_source, image_step

RESULTS = Path(__file__).parent / "results"


@dataclass
class Result:
    workload: str
    contender: str
    workers: int
    batches_per_second: float
    samples_per_second: float
    first_batch_seconds: float
    trainer_cpu_per_1000: float
    repeats: list[float]
    one_process: bool = False  # no worker processes: W does not apply (a flat line in the plot)


def measure(
    workload: str,
    contender: str,
    workers: int,
    batch_size: int,
    make_epochs: Callable[[], Iterator[Iterable[Any]]],
    repeats: int,
    one_process: bool = False,
) -> Result:
    """``make_epochs()`` yields one iterable per epoch (the first yield may build everything)."""
    rates: list[float] = []
    cpu = 0.0
    timed_batches = 0
    first_batch = 0.0
    with H.Clock() as start:
        epochs = make_epochs()
    try:
        for epoch in range(repeats + 1):
            batches = next(epochs)
            count = 0
            with H.Clock() as clock:
                for batch in batches:
                    if epoch == 0 and count == 0:
                        first_batch = start.lap()
                    count += 1
                    del batch
            if epoch > 0:
                rates.append(count / clock.wall)
                cpu += clock.cpu
                timed_batches += count
    finally:
        epochs.close()
    rate = statistics.median(rates)
    return Result(
        workload,
        contender,
        workers,
        rate,
        rate * batch_size,
        first_batch,
        1000 * cpu / max(timed_batches, 1),
        rates,
        one_process,
    )


# ------------------------------------------------------------------------------- contenders
def in_process(
    source_factory: Callable[[], Any],
    step: Callable[..., Any],
    capture: bool,
    batch_size: int,
    threads: int,
) -> Callable[[], Iterator[Iterable[Any]]]:
    def epochs() -> Iterator[Iterable[Any]]:
        import nvidia.dali.experimental.dynamic as ndd

        import workers

        ctx = workers.make_context(threads, None)
        source = source_factory()

        def one_epoch() -> Iterator[Any]:
            # the worker's own epoch iterator, without the process and the transport around it
            for inputs in workers.epoch_iterator(source, batch_size, ctx, capture):
                out = step(*inputs) if isinstance(inputs, tuple) else step(inputs)
                yield {k: ndd.as_tensor(v).evaluate() for k, v in out.items()}

        while True:
            yield one_epoch()

    return epochs


def with_loader(
    source: Any, step: Any, batch_size: int, workers: int, capture: bool, threads: int
) -> Callable[[], Iterator[Iterable[Any]]]:
    def epochs() -> Iterator[Iterable[Any]]:
        with Loader(
            source,
            step,
            batch_size=batch_size,
            num_workers=workers,
            capture=capture,
            num_threads=max(1, threads // workers),
        ) as loader:
            while True:
                yield loader

    return epochs


def with_torch(
    dataset: Any, workers: int, batch_size: int | None = None
) -> Callable[[], Iterator[Iterable[Any]]]:
    """``batch_size=None``: the dataset's items are batches; else torch batches its samples."""

    def epochs() -> Iterator[Iterable[Any]]:
        import torch.utils.data

        data = torch.utils.data.DataLoader(
            dataset,
            batch_size=batch_size,
            num_workers=workers,
            persistent_workers=True,
            multiprocessing_context="spawn",
            prefetch_factor=2,
        )
        while True:
            yield data

    return epochs


# ------------------------------------------------------------------------------- workloads
@dataclass
class Workload:
    """One workload as every contender runs it."""

    name: str
    batch_size: int
    in_process_source: Callable[[], Any]  # builds the in-process reader/ExternalSource
    step: Callable[..., Any]
    loader_source: Any  # the Loader's source(shard)
    dataset: Any  # the torch DataLoader contender's dataset
    classic_images: Callable[[], Iterator[Iterable[Any]]] | None = None  # DALI classic, 1 process
    classic_python: Callable[[int], Iterator[Iterable[Any]]] | None = None  # ... with W py workers
    files_source: Any = None  # the Loader over sharded_files, when the workload reads files
    pillow_dataset: Any = None  # torch DataLoader over Pillow + numpy, when it reads images


def run(quick: bool, repeats: int, threads: int) -> list[Result]:
    widths = [2] if quick else [1, 2, 4]
    results: list[Result] = []
    root = str(ensure_sample_dataset())
    image_batches = len(list_images(root)[0]) // 64
    py_batches = 24 if quick else 48
    tiny_batches = 400 if quick else 2000
    reader = functools.partial(image_source, root=root, batch_size=64, shuffle=True)
    workloads = [
        Workload(
            "images",
            64,
            functools.partial(_single_shard, reader),
            image_step,
            reader,
            S.DaliEagerDataset("images", image_batches, root),
            files_source=functools.partial(S.files_source, root=root, batch_size=64),
            pillow_dataset=S.PillowImageDataset(root),
            classic_images=functools.partial(classic.images_epochs, root, 64, threads),
        ),
        Workload(
            "python",
            S.PY_BATCH,
            functools.partial(_python_es, py_batches),
            S.light_step,
            functools.partial(S.python_source, batches=py_batches),
            S.DaliEagerDataset("python", py_batches),
            classic_python=lambda w: classic.python_epochs(py_batches, w, threads),
        ),
        Workload(
            "tiny",
            S.TINY_BATCH,
            functools.partial(_tiny_es, tiny_batches),
            S.tiny_step,
            functools.partial(S.tiny_source, batches=tiny_batches),
            S.DaliEagerDataset("tiny", tiny_batches),
        ),
    ]

    def record(
        workload: Workload, contender: str, workers: int, epochs: Any, one_process: bool = False
    ) -> None:
        result = measure(
            workload.name, contender, workers, workload.batch_size, epochs, repeats, one_process
        )
        results.append(result)
        print(
            f"  {result.workload:<7} {result.contender:<24} W={result.workers} "
            f"{result.batches_per_second:9.1f} batches/s",
            flush=True,
        )

    for workload in workloads:
        batch = workload.batch_size
        for capture in (True, False):
            mode = "capture" if capture else "eager"
            record(
                workload,
                f"in-process {mode}",
                1,
                in_process(workload.in_process_source, workload.step, capture, batch, threads),
                one_process=True,
            )
        if workload.classic_images is not None:
            record(workload, CLASSIC, 1, workload.classic_images, one_process=True)
        for w in widths:
            record(workload, "torch DataLoader", w, with_torch(workload.dataset, w))
            if workload.pillow_dataset is not None:
                record(
                    workload,
                    "torch Pillow+numpy",
                    w,
                    with_torch(workload.pillow_dataset, w, batch_size=batch),
                )
            if workload.classic_python is not None:
                record(workload, CLASSIC, w, functools.partial(workload.classic_python, w))
            if workload.files_source is not None:
                record(
                    workload,
                    "loader sharded_files",
                    w,
                    with_loader(workload.files_source, workload.step, batch, w, True, threads),
                )
            for capture in (True, False):
                mode = "capture" if capture else "eager"
                record(
                    workload,
                    f"loader {mode}",
                    w,
                    with_loader(workload.loader_source, workload.step, batch, w, capture, threads),
                )
    for w in widths:
        overhead = trainer_overhead(w, 600 if quick else 2000)
        OVERHEAD[w] = overhead
        print(f"  tiny    trainer overhead (busy trainer) W={w} {overhead * 1e6:9.1f} us/batch")
    return results


def _spin(seconds: float) -> None:
    """Busy the trainer thread for ``seconds`` of its own CPU time (not wall time: a thread
    preempted by the workers would spin for less CPU, and the subtraction below would be off)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def trainer_overhead(workers: int, batches: int, compute: float = 1e-3) -> float:
    """The loader's CPU cost per tiny batch in the trainer thread while the trainer is busy
    (``compute`` seconds of its CPU per batch, as a training step would), so batches are ready
    when asked for: the thread's CPU time inside ``next()`` and the batch's release, summed over
    the epoch (a wall-time spin subtracted afterwards is off when workers share the cores)."""
    source = functools.partial(S.tiny_source, batches=batches)
    with Loader(source, S.tiny_step, batch_size=S.TINY_BATCH, num_workers=workers) as loader:
        for batch in loader:  # warm up: trace, arena, first faults
            del batch
        batches_of_epoch = iter(loader)
        spent = 0.0
        count = 0
        while True:
            started = time.thread_time()
            try:
                batch = next(batches_of_epoch)
            except StopIteration:
                break
            del batch  # its finalizer queues the release (sent inside a later next())
            spent += time.thread_time() - started
            count += 1
            _spin(compute)
        return spent / count


OVERHEAD: dict[int, float] = {}
CLASSIC = "DALI classic + plugin"


def _single_shard(reader: Callable[..., Any]) -> Any:
    from loader import Shard

    return reader(Shard.make(rank=0, world_size=1, worker=0, num_workers=1, seed=0))


def _python_es(batches: int) -> Any:
    import nvidia.dali.experimental.dynamic as ndd

    return ndd.ExternalSource(S.PythonBatches(batches), cycle="raise")


def _tiny_es(batches: int) -> Any:
    import nvidia.dali.experimental.dynamic as ndd

    return ndd.ExternalSource(S.TinyBatches(batches), cycle="raise")


# ------------------------------------------------------------------------------- output
COLUMNS = [
    H.Col("workload", left=True),
    H.Col("contender", left=True),
    H.Col("W"),
    H.Col("batches/s", ".1f"),
    H.Col("samples/s", ".0f"),
    H.Col("vs best"),
    H.Col("1st batch s", ".2f"),
    H.Col("trainer CPU s/1k", ".3f"),
]


def render(results: list[Result]) -> str:
    cells: list[tuple[Any, ...] | None] = []
    for workload in dict.fromkeys(r.workload for r in results):
        rows = [r for r in results if r.workload == workload]
        best = max(r.batches_per_second for r in rows)
        cells += [
            (
                r.workload,
                r.contender,
                r.workers,
                r.batches_per_second,
                r.samples_per_second,
                H.ratio(r.batches_per_second, best),
                r.first_batch_seconds,
                r.trainer_cpu_per_1000,
            )
            for r in rows
        ]
        cells.append(None)
    return H.table(COLUMNS, cells)


def targets(results: list[Result]) -> list[str]:
    def rate(workload: str, contender: str, workers: int = 2) -> float | None:
        for r in results:
            if (r.workload, r.contender) == (workload, contender) and (
                r.workers == workers or r.one_process
            ):
                return r.batches_per_second
        return None

    lines = []
    checks = [
        ("images: loader(W=2) / in-process capture >= 0.95", "images", "in-process capture", 0.95),
        ("images: loader(W=2) / torch DataLoader(W=2) >= 1.2", "images", "torch DataLoader", 1.2),
        ("python: loader(W=2) / in-process capture >= 1.7", "python", "in-process capture", 1.7),
    ]
    for text, workload, other, goal in checks:
        ours, theirs = rate(workload, "loader capture"), rate(workload, other)
        if ours and theirs:
            ratio = ours / theirs
            lines.append(f"{text}: {ratio:.2f} {'met' if ratio >= goal else 'MISSED'}")
    for workers in (1, 2, 4):
        ours, pillow = (
            rate("images", "loader capture", workers),
            rate("images", "torch Pillow+numpy", workers),
        )
        if ours and pillow:
            lines.append(
                f"images: loader / torch Pillow+numpy DataLoader, W={workers}: {ours / pillow:.2f}x"
            )
    ours, dali = rate("images", "loader capture"), rate("images", CLASSIC)
    if ours and dali:
        ratio = ours / dali
        lines.append(
            f"images: loader(W=2) / {CLASSIC} >= 0.97: {ratio:.2f} "
            f"{'met' if ratio >= 0.97 else 'MISSED'} in this one run (alternated pairs: "
            "python -m bench.classic)"
        )
    ours, dali = rate("python", "loader capture"), rate("python", CLASSIC)
    if ours and dali:
        lines.append(f"python: loader / {CLASSIC}, W=2: {ours / dali:.2f}x")
    files, reader = rate("images", "loader sharded_files"), rate("images", "loader capture")
    if files and reader:
        ratio = files / reader
        lines.append(
            f"images: sharded_files / readers.File (loader capture, W=2) >= 0.97: {ratio:.2f} "
            f"{'met' if ratio >= 0.97 else 'MISSED'} in this one run (alternated pairs: "
            "python -m bench.files)"
        )
    for workers, overhead in sorted(OVERHEAD.items()):
        per = overhead * 1e6
        lines.append(
            f"tiny: trainer-side cost while the trainer is busy, W={workers}: {per:.1f} us per "
            f"batch (target <= 25): {'met' if per <= 25 else 'MISSED'}"
        )
    tiny = [r for r in results if r.workload == "tiny" and r.contender == "loader capture"]
    for r in tiny:
        per = r.trainer_cpu_per_1000 * 1000
        lines.append(
            f"tiny: trainer CPU per batch when starved (waits on every batch), W={r.workers}: "
            f"{per:.1f} us (target <= 50): {'met' if per <= 50 else 'MISSED'}"
        )
    return lines


# One colour and marker per contender, the same in every panel.
STYLES: dict[str, tuple[str, str]] = {
    "in-process capture": ("tab:blue", "s"),
    "in-process eager": ("tab:cyan", "D"),
    "torch DataLoader": ("tab:orange", "^"),
    "torch Pillow+numpy": ("tab:olive", "v"),
    CLASSIC: ("tab:green", "P"),
    "loader sharded_files": ("tab:pink", "X"),
    "loader capture": ("tab:red", "o"),
    "loader eager": ("tab:purple", "*"),
}
PANELS = (
    ("samples_per_second", "samples/s", "linear"),
    ("trainer_cpu_per_1000", "trainer CPU s per 1k batches", "log"),
    ("first_batch_seconds", "first batch s", "linear"),
)


def plot(results: list[Result], path: Path) -> bool:
    """Throughput, trainer CPU and first batch (rows) per workload (columns) against W; a
    contender without worker processes is a dashed line at its one value."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib import ticker
    except ImportError:
        return False
    workloads = list(dict.fromkeys(r.workload for r in results))
    contenders = list(dict.fromkeys(r.contender for r in results))
    spare = iter(["tab:brown", "tab:gray", "black", "gold"])
    styles = {c: STYLES.get(c) or (next(spare, "black"), "h") for c in contenders}
    figure, axes = plt.subplots(
        len(PANELS),
        len(workloads),
        figsize=(5 * len(workloads), 3.2 * len(PANELS) + 0.8),
        squeeze=False,
    )
    handles: dict[str, Any] = {}
    for column, workload in enumerate(workloads):
        rows = [r for r in results if r.workload == workload]
        widths = sorted({r.workers for r in rows if not r.one_process}) or [1]
        for row, (field, label, scale) in enumerate(PANELS):
            axis = axes[row][column]
            for contender in dict.fromkeys(r.contender for r in rows):
                mine = sorted(
                    ((r.workers, getattr(r, field)) for r in rows if r.contender == contender),
                    key=lambda point: point[0],
                )
                colour, marker = styles[contender]
                flat = all(r.one_process for r in rows if r.contender == contender)
                xs = widths if flat else [p[0] for p in mine]
                ys = [mine[0][1]] * len(widths) if flat else [p[1] for p in mine]
                (line,) = axis.plot(
                    xs,
                    ys,
                    linestyle="--" if flat else "-",
                    marker=marker,
                    color=colour,
                    markersize=5,
                    label=contender,
                )
                handles.setdefault(contender, line)
            axis.set_yscale(scale)
            if scale == "log":
                axis.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
                axis.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
                axis.yaxis.set_minor_formatter(ticker.NullFormatter())
            if row == 0:
                axis.set_title(workload)
            if row == len(PANELS) - 1:
                axis.set_xlabel("worker processes (W)")
            axis.set_ylabel(label)
            axis.set_xticks(widths)
            axis.grid(alpha=0.3)
    figure.legend(list(handles.values()), list(handles), loc="lower center", ncol=4, fontsize=8)
    figure.tight_layout(rect=(0, 0.07, 1, 1))
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="W=2 only, fewer batches (< 3 min)")
    parser.add_argument("--repeats", type=int, default=3, help="timed epochs per contender")
    H.add_threads(parser)


def parser() -> argparse.ArgumentParser:
    return H.parser("", __doc__, add_arguments)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    threads = H.threads(args.threads)
    started = time.perf_counter()
    results = run(args.quick, args.repeats, threads)
    print()
    print(render(results))
    for line in targets(results):
        print(line)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "latest.json").write_text(
        json.dumps(
            {
                "quick": args.quick,
                "threads": threads,
                "results": [asdict(r) for r in results],
                "trainer_overhead_us": {w: o * 1e6 for w, o in OVERHEAD.items()},
            },
            indent=2,
        )
    )
    if plot(results, RESULTS / "throughput.png"):
        print(f"\nplot: {RESULTS / 'throughput.png'}")
    print(f"total: {time.perf_counter() - started:.0f} s")
