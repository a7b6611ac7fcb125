"""``bash bench/anchors.sh``: this loader beside LitData and MosaicML Streaming on one S3 server.

One command, one run, one table per dataset size. The same samples (small JPEGs with a label and
an id) are written in each one's format: tar shards (indexed with ``python -m loader.tars index``,
as this loader wants), LitData chunks (``litdata.optimize``) and Mosaic's MDS shards
(``MDSWriter``), about the same number of shards each, uploaded to one bucket of moto's S3 server
(a process of its own). Every loader reaches it through :class:`bench._s3.CountingProxy`, so the
requests and bytes each one costs are counted, not guessed.

Each loader then runs, each in a fresh process with an empty cache (a new node's), in turn:

* **first**: construct the loader and take its first batch (seconds; requests, LISTs and bytes
  served until then), read the whole epoch (samples/s after the first batch, bytes served, every
  sample once?) and save the loader's state at half the epoch;
* **resume**: a new process loads that state and takes its first batch (seconds, requests).

Each size starts with one more run of this loader to its first batch with no analysis of DALI's
on disk yet (a machine's first job: :mod:`workers.startup`); the runs in the table find
it, as every later job on a machine does. ``--setup S`` gives every script ``S`` seconds of its
own CPU work between importing its data library and building the loader, as a model's
construction would (this loader's worker server imports DALI meanwhile); after each size's table
the starts and resumes are measured again with ``--also-setup S`` seconds of it (2 by default),
in the same run.

This loader runs twice: its step names DALI through ``from loader import ndd`` (the trainer never
imports DALI) and, as ``loader-direct``, its script also imports
``nvidia.dali.experimental.dynamic``, as a step module with the direct import does. The table
shows each script's imports (process start until imported), its resident memory at the first
batch and whether it holds DALI. ``--no-anchors``: these two only (no anchors' environment).

``--format parquet``: the same Parquet files (written by ``datasets``), local and on the S3
server, for this loader's ``ParquetDataset``, ``datasets`` streaming (with and without
``reshard()``) and LitData's Parquet streaming (:mod:`bench._anchor_parquet`).

This project's packages are compiled to bytecode first (:func:`compile_packages`), as an install
would have them, like the anchors'. The same work in each: batch 32, 2 worker processes,
shuffled, each JPEG decoded and resized to 64x64 (DALI's decoder here, Pillow in the anchors'
DataLoader workers). The anchors run in their own
environment (``--anchors-python``; ``bench/anchors.sh`` makes it from
``bench/anchors-requirements.txt``): they pin a torch, a numpy and a transformers other than the
test extra's, so they are the bench's extra, not the package's.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import _anchor_parquet
from bench import _harness as H
from bench._s3 import CountingProxy, S3Server, Served

LOADERS = ("loader", "loader-direct", "litdata", "mosaic")
#: The contenders without the anchors (``--no-anchors``: their environment is not needed).
OURS = ("loader", "loader-direct")
NAMES = {
    "loader": "this loader (from loader import ndd)",
    "loader-direct": "this loader, DALI imported directly",
    "litdata": "LitData 0.2.76",
    "mosaic": "Mosaic Streaming 0.13",
}


def jpegs(count: int, side: int, seed: int = 0) -> list[bytes]:
    """``count`` distinct small JPEGs (a gradient with noise and a few shapes each)."""
    import numpy as np
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    images = []
    ramp = np.linspace(0, 255, side, dtype=np.float32)
    for _ in range(count):
        base = rng.uniform(0.2, 1.0, size=3) * (ramp[None, :, None] + ramp[:, None, None]) / 2
        pixels = np.clip(base + rng.normal(0, 18, (side, side, 3)), 0, 255).astype(np.uint8)
        image = Image.fromarray(pixels)
        draw = ImageDraw.Draw(image)
        for _shape in range(3):
            x, y = (int(v) for v in rng.integers(0, side - 8, 2))
            draw.ellipse(
                [x, y, x + 8 + int(rng.integers(0, side // 3)), y + 12],
                fill=tuple(int(v) for v in rng.integers(0, 256, 3)),
            )
        data = io.BytesIO()
        image.save(data, format="JPEG", quality=88)
        images.append(data.getvalue())
    return images


def write_tars(directory: Path, shards: int, per_shard: int, side: int) -> list[Path]:
    """The samples as tar shards: sample ``i`` is ``s<i>.jpg``, ``.cls`` (``i % 1000``), ``.id``."""
    pool = jpegs(256, side)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for number in range(shards):
        path = directory / f"train-{number:06d}.tar"
        with tarfile.open(path, "w") as tar:
            for sample in range(number * per_shard, (number + 1) * per_shard):
                for ext, data in (
                    ("jpg", pool[(sample * 7919) % len(pool)]),
                    ("cls", str(sample % 1000).encode()),
                    ("id", str(sample).encode()),
                ):
                    info = tarfile.TarInfo(f"s{sample:08d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        paths.append(path)
    return paths


def upload(server: S3Server, root: Path, bucket: str, prefix: str) -> int:
    """Every file under ``root`` to ``s3://<bucket>/<prefix>/...``; returns how many."""
    files = [p for p in sorted(root.rglob("*")) if p.is_file()]
    client = server.client()
    try:
        with ThreadPoolExecutor(8) as pool:
            list(
                pool.map(
                    lambda p: client.upload_file(
                        str(p), bucket, f"{prefix}/{p.relative_to(root).as_posix()}"
                    ),
                    files,
                )
            )
    finally:
        client.close()
    return len(files)


@dataclass
class Counted:
    requests: int = 0
    lists: int = 0
    bytes: int = 0

    @classmethod
    def of(cls, served: list[Served], bucket: str) -> Counted:
        lists = sum(1 for s in served if s.method == "GET" and _is_list(s, bucket))
        return cls(len(served), lists, sum(s.bytes for s in served))


def _is_list(served: Served, bucket: str) -> bool:
    return "list-type" in served.query or served.path.strip("/") == bucket


@dataclass
class Outcome:
    started_s: float | None = None  # from the process's start (its imports included)
    imported_s: float | None = None  # the process's start until its imports were done
    rss_mb: float | None = None  # the trainer's resident memory at the first batch
    dali: bool | None = None  # the trainer held DALI's modules at the first batch
    first_s: float | None = None
    first: Counted = field(default_factory=Counted)
    epoch_s: float | None = None
    epoch_samples: int = 0
    epoch_unique: int = 0
    epoch: Counted = field(default_factory=Counted)
    error: str = ""
    progress: list[str] = field(default_factory=list)  # the scan's progress lines (stderr)
    #: this loader's start from its trace: phase -> seconds (the longest worker's), in order
    start: dict[str, float] = field(default_factory=dict)
    #: ``resume-epoch``: the ids the resumed run delivered (its first batch to the epoch's end)
    rest_ids: list[int] = field(default_factory=list)


def measure(
    python: str,
    name: str,
    mode: str,
    proxy: CountingProxy,
    bucket: str,
    state: Path,
    limit: float,
    extra: dict[str, str] | None = None,
) -> Outcome:
    """One run of ``bench._anchor_runs`` (see there), counted through ``proxy``; ``extra``:
    environment variables of this run."""
    outcome = Outcome()
    layout = state.parent / "layout.json"
    # (LitData's state names its cache directory: its resume needs the same path, emptied;
    # Mosaic waits ~60 s on a local directory a finished process used: a new one each run)
    litdata = name in ("litdata", "pq-litdata")
    cache = state.parent / (f"cache-{name}" if litdata else f"cache-{name}-{mode}")
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir()
    environment = dict(
        os.environ,
        BENCH_ANCHORS_LAYOUT=str(layout),
        BENCH_ANCHORS_CACHE=str(cache),
        PYTHONUNBUFFERED="1",
        **(extra or {}),
    )
    proxy.reset()
    command = [python, "-m", "bench._anchor_runs", name, mode, proxy.endpoint, bucket, str(state)]
    with tempfile.TemporaryFile() as errors:
        child = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
            env=environment,
            cwd=Path(__file__).resolve().parent.parent,
        )
        assert child.stdin is not None and child.stdout is not None
        launched = time.monotonic()
        deadline = launched + limit
        try:
            for line in child.stdout:
                record = json.loads(line)
                if record["at"] == "imported":
                    outcome.imported_s = time.monotonic() - launched
                elif record["at"] == "first":
                    outcome.started_s = time.monotonic() - launched
                    outcome.first_s = record["seconds"]
                    outcome.rss_mb = record.get("rss_mb")
                    outcome.dali = record.get("dali")
                    outcome.first = Counted.of(proxy.records(), bucket)
                    proxy.reset()
                    child.stdin.write("\n")
                    child.stdin.flush()
                elif record["at"] == "start":
                    outcome.start = record["phases"]
                elif record["at"] == "epoch":
                    outcome.epoch_s = record["seconds"]
                    outcome.epoch_samples = record["samples"]
                    outcome.epoch_unique = record["unique"]
                    outcome.epoch = Counted.of(proxy.records(), bucket)
                elif record["at"] == "rest":
                    outcome.rest_ids = record["ids"]
                if time.monotonic() > deadline:
                    child.kill()
            child.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        errors.seek(0)
        lines = [ln for ln in errors.read().decode(errors="replace").splitlines() if ln.strip()]
        outcome.progress = [ln for ln in lines if " loader " in ln and "index" in ln]
        if child.returncode:
            outcome.error = (lines[-1] if lines else f"exit {child.returncode}")[:160]
    return outcome


def prepare(
    server: S3Server,
    proxy: CountingProxy,
    anchors: str,
    bucket: str,
    shards: int,
    per_shard: int,
    side: int,
    directory: Path,
    unindexed: bool = False,
    anchored: bool = True,
) -> dict[str, Any]:
    """Write and upload the three formats (``anchored=False``: the tar shards only); index the
    tar shards through the proxy."""
    tars = write_tars(directory / "tars", shards, per_shard, side)
    sizes = {"tars": sum(p.stat().st_size for p in tars)}
    formats = ("litdata", "mds") if anchored else ()
    for fmt in formats:
        shutil.rmtree(directory / fmt, ignore_errors=True)  # (LitData will not write over one)
        subprocess.run(
            [
                anchors,
                "-m",
                "bench._anchor_write",
                fmt,
                str(directory / "tars"),
                str(directory / fmt),
                str(per_shard),
            ],
            check=True,
            cwd=Path(__file__).resolve().parent.parent,
        )
    server.bucket(bucket)
    counts = {}
    for fmt in ("tars", *formats):
        counts[fmt] = upload(server, directory / fmt, bucket, fmt)
        sizes[fmt] = sum(p.stat().st_size for p in (directory / fmt).rglob("*") if p.is_file())
    if unindexed:  # (the same shards again, never indexed)
        upload(server, directory / "tars", bucket, "raw")
    pattern = f"s3://{bucket}/tars/train-{{000000..{shards - 1:06d}}}.tar"
    proxy.reset()
    started = time.monotonic()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "loader.tars",
            "index",
            pattern,
            "--workers",
            "2",
            "--storage-options",
            json.dumps(server.options(proxy.endpoint)),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
        # (a new node's cache: no index this machine made before is reused)
        env=dict(os.environ, DALI_LOADER_CACHE_DIR=str(directory / "index-cache")),
    )
    index = Counted.of(proxy.records(), bucket)
    return {
        "bucket": bucket,
        "tars": pattern,
        "unindexed": pattern.replace("/tars/", "/raw/"),
        "samples": shards * per_shard,
        "objects": counts,
        "sizes": sizes,
        "index_seconds": time.monotonic() - started,
        "index_requests": index.requests,
    }


def run_size(
    args: argparse.Namespace, server: S3Server, proxy: CountingProxy, shards: int, per_shard: int
) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-anchors-") as scratch:
        directory = Path(scratch)
        bucket = f"anchors-{shards}"  # (one bucket per size)
        unindexed = shards >= args.unindexed_from
        layout = prepare(
            server,
            proxy,
            args.anchors_python,
            bucket,
            shards,
            per_shard,
            args.side,
            directory,
            unindexed,
            anchored=args.anchors,
        )
        (directory / "layout.json").write_text(json.dumps(layout))
        print(
            f"\n{shards} shards x {per_shard} samples ({layout['samples']} samples; objects: "
            + ", ".join(
                f"{k} {v} ({layout['sizes'][k] / 1e6:.1f} MB)" for k, v in layout["objects"].items()
            )
            + f"); index command: {layout['index_seconds']:.1f} s, "
            + f"{layout['index_requests']} requests"
            + (f"; each script's set-up: {args.setup:g} s of CPU" if args.setup else ""),
            flush=True,
        )
        # DALI's source analysis, which this loader keeps on disk (workers.startup): the
        # first run of this size starts with none (a machine's first job), the rest find it
        analysis = {"DALI_LOADER_ANALYSIS_CACHE": str(directory / "analysis-cache")}
        cold = measure(
            sys.executable,
            "loader",
            "first-only",
            proxy,
            bucket,
            directory / "cold.state",
            args.limit,
            analysis,
        )
        mode = "first" if args.epoch else "first-only"
        results = run_each(args, proxy, bucket, directory, mode, analysis, {})
        print(table(results, layout))
        print(start_phases(results), flush=True)
        if args.also_setup > 0:
            seconds = {"BENCH_ANCHORS_SETUP": str(args.also_setup)}
            results = run_each(args, proxy, bucket, directory, "first-only", analysis, seconds)
            print(f"\nthe same starts with {args.also_setup:g} s of each script's own set-up:")
            print(table(results, layout, only=START_ROWS))
            print(start_phases(results), flush=True)
        print(
            "\nthis loader's first job on a machine (DALI's source analysis not on disk yet): "
            + (
                f"construct -> first batch {cold.first_s:.1f} s "
                f"({cold.started_s:.1f} s after the process started)"
                if cold.first_s is not None and cold.started_s is not None
                else f"failed: {cold.error}"
            ),
            flush=True,
        )
        if unindexed:
            run = measure(
                sys.executable,
                "loader-unindexed",
                "first-only",
                proxy,
                bucket,
                directory / "unindexed.state",
                args.limit,
            )
            print(
                f"\nthis loader over the same {shards} shards never indexed: "
                + (
                    f"first batch {run.first_s:.1f} s after construct "
                    f"({run.started_s:.1f} s after the process started), "
                    f"{run.first.requests} requests, {run.first.bytes / 1e6:.1f} MB before it"
                    if run.first_s is not None
                    else f"failed: {run.error}"
                )
                + f"; the scan's progress, as logged ({len(run.progress)} lines):",
                flush=True,
            )
            for line in (
                run.progress[:3]
                + (["..."] if len(run.progress) > 4 else [])
                + (run.progress[3:][-1:])
            ):
                print(f"    {line[:200]}")


#: The rows of the table measured again with ``--also-setup`` seconds of the script's own CPU
#: work before it builds its loader, as a training script builds its model.
START_ROWS = (
    "process start → first batch, s",
    "the trainer's resident memory at the first batch, MB",
    "construct → first batch, s",
    "resume: process start → first batch, s",
    "resume: construct and load → first batch, s",
)


def run_each(
    args: argparse.Namespace,
    proxy: CountingProxy,
    bucket: str,
    directory: Path,
    mode: str,
    analysis: dict[str, str],
    extra: dict[str, str],
) -> dict[str, list[tuple[Outcome, Outcome]]]:
    """Each loader's run in ``mode`` and its resume, ``--repeats`` times, each loader in each
    place in turn; ``extra``: environment of every run (``analysis``: of this loader's too)."""
    contenders = LOADERS if args.anchors else OURS
    results: dict[str, list[tuple[Outcome, Outcome]]] = {name: [] for name in contenders}
    order = list(contenders)
    for repeat in range(args.repeats):
        for name in order:
            ours = name in OURS
            python = sys.executable if ours else args.anchors_python
            environment = {**extra, **(analysis if ours else {})}
            state = directory / f"{name}.state"
            first = measure(python, name, mode, proxy, bucket, state, args.limit, environment)
            resume = (
                measure(python, name, "resume", proxy, bucket, state, args.limit, environment)
                if state.exists()
                else Outcome(error="no state saved")
            )
            state.unlink(missing_ok=True)
            results[name].append((first, resume))
            print(f"  run {repeat + 1} {name}: {_brief(first, resume)}", flush=True)
        order = order[1:] + order[:1]
    return results


def start_phases(results: dict[str, list[tuple[Outcome, Outcome]]]) -> str:
    """Where this loader's first start of the table went, from its trace (``save_trace``)."""
    runs = [first for first, _resume in results["loader"] if first.start]
    if not runs:
        return "this loader's start, from its trace: none saved"
    phases = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in runs[0].start.items())
    return f"this loader's start (run 1), from its trace: {phases}"


def _brief(first: Outcome, resume: Outcome) -> str:
    parts = [
        f"first {first.first_s:.1f} s" if first.first_s is not None else f"failed: {first.error}"
    ]
    if first.epoch_s:
        parts.append(f"epoch {first.epoch_samples / first.epoch_s:.0f} samples/s")
    parts.append(
        f"resume {resume.first_s:.1f} s"
        if resume.first_s is not None
        else f"resume failed: {resume.error}"
    )
    return ", ".join(parts)


def _span(values: list[float], form: str) -> str:
    if not values:
        return "—"
    low, high = min(values), max(values)
    return (
        form.format(low)
        if len(values) == 1 or form.format(low) == form.format(high)
        else (f"{form.format(low)}-{form.format(high)}")
    )


def table(
    results: dict[str, list[tuple[Outcome, Outcome]]],
    layout: dict[str, Any],
    only: tuple[str, ...] = (),
) -> str:
    """The side-by-side table: each cell min-max over the runs (one value when they agree);
    ``only``: these rows (by label), else all."""
    rows: list[tuple[str, list[str]]] = []

    def row(label: str, pick: Any, form: str) -> None:
        cells = []
        for name in results:
            values = [
                v for v in (pick(first, resume) for first, resume in results[name]) if v is not None
            ]
            failed = [
                o.error for first, resume in results[name] for o in (first, resume) if o.error
            ]
            cell = _span(values, form)
            cells.append(cell if values or not failed else f"failed ({failed[0][:40]})")
        rows.append((label, cells))

    row("process start → first batch, s", lambda f, r: f.started_s, "{:.1f}")
    row("construct → first batch, s", lambda f, r: f.first_s, "{:.1f}")
    row("the script's imports (process start → imported), s", lambda f, r: f.imported_s, "{:.1f}")
    row("the trainer's resident memory at the first batch, MB", lambda f, r: f.rss_mb, "{:.0f}")
    row("  DALI imported in the trainer", lambda f, r: f.dali, "{:d}")
    row(
        "requests before the first batch",
        lambda f, r: f.first.requests if f.first_s else None,
        "{:d}",
    )
    row("  of them LISTs", lambda f, r: f.first.lists if f.first_s else None, "{:d}")
    row("  MB served before it", lambda f, r: f.first.bytes / 1e6 if f.first_s else None, "{:.2f}")
    row(
        "epoch, samples/s (after the first batch)",
        lambda f, r: f.epoch_samples / f.epoch_s if f.epoch_s else None,
        "{:.0f}",
    )
    row(
        "  MB served in the epoch",
        lambda f, r: f.epoch.bytes / 1e6 if f.epoch_s else None,
        "{:.1f}",
    )
    row(
        "  every sample once",
        lambda f, r: (
            (1 if f.epoch_unique == f.epoch_samples == layout["samples"] else 0)
            if f.epoch_s
            else None
        ),
        "{:d}",
    )
    row("resume: process start → first batch, s", lambda f, r: r.started_s, "{:.1f}")
    row("resume: construct and load → first batch, s", lambda f, r: r.first_s, "{:.1f}")
    row("  requests before it", lambda f, r: r.first.requests if r.first_s else None, "{:d}")
    shown = []
    for label, cells in rows:
        if only and label not in only:
            continue
        if label.strip() in ("every sample once", "DALI imported in the trainer"):
            cells = [{"1": "yes", "0": "no"}.get(c, c.replace("0-1", "not always")) for c in cells]
        shown.append([label, *cells])
    columns = [H.Col("", left=True), *(H.Col(NAMES[n]) for n in results)]
    return H.table(columns, shown, markdown=True)


def parser() -> argparse.ArgumentParser:
    return H.parser("anchors", __doc__, add_arguments)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--size",
        action="append",
        default=None,
        metavar="SHARDSxSAMPLES",
        help="a dataset: shards x samples per shard (default: 1000x20 and 10000x4)",
    )
    parser.add_argument(
        "--format",
        choices=("tars", "parquet"),
        default="tars",
        help="tars: tar shards, LitData chunks, MDS (the default); parquet: the same Parquet "
        "files, written by datasets, for this loader, datasets streaming and LitData, local and "
        "on S3 (--size FILESxROWS, 40x300 by default)",
    )
    parser.add_argument(
        "--row-group",
        type=int,
        default=100,
        metavar="ROWS",
        help="--format parquet: rows a row group (100, as the Hub's converter writes)",
    )
    parser.add_argument("--repeats", type=int, default=1, help="runs of each loader per size")
    parser.add_argument(
        "--unindexed-from",
        type=int,
        default=10000,
        metavar="SHARDS",
        help="from this many shards on, also run this loader over a copy never indexed",
    )
    parser.add_argument("--side", type=int, default=96, help="the JPEGs' side in pixels")
    parser.add_argument(
        "--no-epoch", dest="epoch", action="store_false", help="first batch and resume only"
    )
    parser.add_argument("--limit", type=float, default=900.0, help="seconds one run may take")
    parser.add_argument(
        "--setup",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="seconds of CPU each script spends between importing its data library and "
        "building the loader (a model's construction); 0 by default",
    )
    parser.add_argument(
        "--also-setup",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="measure each loader's start and resume again with this much set-up (after the "
        "table; 0: not)",
    )
    parser.add_argument(
        "--no-anchors",
        dest="anchors",
        action="store_false",
        help="this loader only (the lazy form and the direct import): no LitData, no Mosaic, "
        "and no anchors' environment needed",
    )
    parser.add_argument(
        "--anchors-python",
        default=os.environ.get("BENCH_ANCHORS_PYTHON", ".venv-anchors/bin/python"),
        help="the anchors' environment's python (bench/anchors.sh makes .venv-anchors)",
    )
    parser.add_argument(
        "--datasets-python",
        default=os.environ.get("BENCH_DATASETS_PYTHON", ".venv-datasets/bin/python"),
        help="--format parquet: the python of Hugging Face datasets' streaming, with torchdata "
        "(bench/anchors.sh makes .venv-datasets; torchdata in the project's environment would "
        "make DALI import torch in this loader's workers)",
    )


def compile_packages() -> None:
    """Write the bytecode of this project's packages (and the bench's) now, as pip does when it
    installs a package: LitData and Mosaic run installed, compiled, and a checkout run with
    ``PYTHONDONTWRITEBYTECODE`` set would otherwise compile this loader's modules again in every
    measured process (~0.12 s of the trainer's imports, more in its worker server)."""
    import compileall

    root = Path(__file__).resolve().parent.parent
    for package in ("ipc", "workers", "loader", "bench"):
        compileall.compile_dir(root / package, quiet=1)


def main(argv: list[str] | None = None) -> None:
    built = parser()
    args = built.parse_args(argv)
    if args.anchors and not Path(args.anchors_python).exists():
        built.error(
            f"{args.anchors_python} does not exist: run bash bench/anchors.sh, which makes it "
            "(or pass --no-anchors)"
        )
    if args.format == "parquet" and args.anchors and not Path(args.datasets_python).exists():
        built.error(
            f"{args.datasets_python} does not exist: run bash bench/anchors.sh --format parquet, "
            "which makes it from bench/datasets-requirements.txt (or pass --no-anchors)"
        )
    default = ["40x300"] if args.format == "parquet" else ["1000x20", "10000x4"]
    sizes = [tuple(int(v) for v in s.lower().split("x")) for s in (args.size or default)]
    os.environ["BENCH_ANCHORS_SETUP"] = str(args.setup)  # (every run's script inherits it)
    compile_packages()
    random.seed(0)
    server = S3Server(threaded=False)
    proxy = CountingProxy(server.endpoint)
    try:
        for shards, per_shard in sizes:
            if args.format == "parquet":
                _anchor_parquet.run_size(args, server, proxy, shards, per_shard)
            else:
                run_size(args, server, proxy, shards, per_shard)
    finally:
        proxy.close()
        server.close()


if __name__ == "__main__":
    main()
