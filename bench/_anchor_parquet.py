"""``bash bench/anchors.sh --format parquet``: this loader's Parquet source beside Hugging Face
``datasets`` streaming and LitData's Parquet streaming, on the same files, local and on S3.

The files are written by ``datasets`` itself (``Dataset.to_parquet``): an ``Image`` column (the
bench's small JPEGs), a ``ClassLabel`` column and an ``id``, ``--row-group`` rows a row group (100:
the Hub's converter and ``datasets`` < 4.1). They lie in a local directory and, the same bytes, in
one bucket of moto's S3 server behind the counting proxy. Preparation, not timed: LitData's
``index_parquet_dataset`` writes its ``index.json`` beside the files (into the bucket for S3: that
is what it does), and ``python -m loader index`` writes this loader's summary beside a copy of
them (so that the plain runs find none).

Each contender, in each place, runs as in :mod:`bench.anchors` (a fresh process, an empty cache):
construct -> first batch, the epoch with a save at its half; then a new process loads that state,
takes its first batch, and reads the rest of the epoch, to tell whether the two halves held every
sample once. The requests and bytes are the proxy's (S3 only: local reads are not counted).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import _harness as H
from bench._s3 import CountingProxy, S3Server

CONTENDERS = (
    "pq-loader",
    "pq-loader-summary",
    "pq-loader-ordered",
    "pq-datasets",
    "pq-datasets-reshard",
    "pq-datasets-ordered",
    "pq-datasets-reshard-ordered",
    "pq-litdata",
)
OURS = ("pq-loader", "pq-loader-summary", "pq-loader-ordered")
NAMES = {
    "pq-loader": "loader",
    "pq-loader-summary": "loader+summary",
    "pq-loader-ordered": "loader, unshuffled",
    "pq-datasets": "datasets (files)",
    "pq-datasets-reshard": "datasets reshard()",
    "pq-datasets-ordered": "datasets, unshuffled",
    "pq-datasets-reshard-ordered": "reshard(), unshuffled",
    "pq-litdata": "LitData",
}
PLACES = ("local", "s3")


def write_parquet(directory: Path, files: int, rows: int, row_group: int, side: int) -> list[Path]:
    """``files`` Parquet files of ``rows`` rows, written by ``datasets`` (``to_parquet``, one
    row group per ``row_group`` rows): ``image`` (``Image``), ``label`` (``ClassLabel`` of
    1,000), ``id`` (int64, the sample's number, for the exactly-once check)."""
    from datasets import ClassLabel, Dataset, Features, Image, Value

    from bench.anchors import jpegs

    pool = jpegs(256, side)
    features = Features(
        {"image": Image(), "label": ClassLabel(num_classes=1000), "id": Value("int64")}
    )
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for number in range(files):
        ids = list(range(number * rows, (number + 1) * rows))
        table = {
            "image": [{"bytes": pool[(i * 7919) % len(pool)], "path": None} for i in ids],
            "label": [i % 1000 for i in ids],
            "id": ids,
        }
        path = directory / f"train-{number:05d}-of-{files:05d}.parquet"
        Dataset.from_dict(table, features=features).to_parquet(str(path), batch_size=row_group)
        paths.append(path)
    return paths


def prepare(
    args: argparse.Namespace,
    server: S3Server,
    proxy: CountingProxy,
    bucket: str,
    files: int,
    rows: int,
    directory: Path,
) -> dict[str, Any]:
    """Write the files, copy them for the summary, upload both, index each as its reader wants."""
    from bench.anchors import Counted, upload

    plain, summarized = directory / "parquet", directory / "parquet-summary"
    written = write_parquet(plain, files, rows, args.row_group, args.side)
    shutil.copytree(plain, summarized)
    server.bucket(bucket)
    for local in (plain, summarized):
        upload(server, local, bucket, local.name)
    options = server.options(proxy.endpoint)
    layout: dict[str, Any] = {
        "bucket": bucket,
        "samples": files * rows,
        "bytes": sum(p.stat().st_size for p in written),
        "parquet": {
            "local": {"files": str(plain), "summary": str(summarized)},
            "s3": {
                "files": f"s3://{bucket}/parquet/",
                "summary": f"s3://{bucket}/parquet-summary/",
            },
        },
        "indexing": {},
    }
    root = Path(__file__).resolve().parent.parent
    for place in PLACES:
        where = layout["parquet"][place]
        extra = ["--storage-options", json.dumps(options)] if place == "s3" else []
        proxy.reset()
        started = time.monotonic()
        subprocess.run(
            [sys.executable, "-m", "loader", "index", where["summary"], *extra],
            check=True,
            stdout=subprocess.DEVNULL,
            env=dict(os.environ, DALI_LOADER_CACHE_DIR=str(directory / "index-cache")),
        )
        ours = (time.monotonic() - started, Counted.of(proxy.records(), bucket).requests)
        theirs = (0.0, 0)
        if args.anchors:
            proxy.reset()
            started = time.monotonic()
            subprocess.run(
                [
                    args.anchors_python,
                    "-m",
                    "bench._anchor_write",
                    "litdata-parquet",
                    where["files"],
                    json.dumps(options if place == "s3" else {}),
                    "0",
                ],
                check=True,
                stdout=subprocess.DEVNULL,
                cwd=root,
            )
            theirs = (time.monotonic() - started, Counted.of(proxy.records(), bucket).requests)
        layout["indexing"][place] = {"loader": ours, "litdata": theirs}
    return layout


def run_size(
    args: argparse.Namespace, server: S3Server, proxy: CountingProxy, files: int, rows: int
) -> None:
    from bench.anchors import measure

    with tempfile.TemporaryDirectory(prefix="bench-anchors-parquet-") as scratch:
        directory = Path(scratch)
        bucket = f"parquet-{files}x{rows}"
        layout = prepare(args, server, proxy, bucket, files, rows, directory)
        (directory / "layout.json").write_text(json.dumps(layout))
        groups = files * -(-rows // args.row_group)
        print(
            f"\n{files} Parquet files x {rows} rows ({layout['samples']} samples, {groups} row "
            f"groups of <= {args.row_group} rows, {layout['bytes'] / 1e6:.1f} MB, written by "
            "datasets' to_parquet); not timed: "
            + "; ".join(
                f"{place}: loader index {i['loader'][0]:.1f} s ({i['loader'][1]} requests)"
                + (
                    f", LitData index_parquet_dataset {i['litdata'][0]:.1f} s "
                    f"({i['litdata'][1]} requests)"
                    if args.anchors
                    else ""
                )
                for place, i in layout["indexing"].items()
            ),
            flush=True,
        )
        # DALI's source analysis, which this loader keeps on disk (workers.startup): one run
        # first makes it (a machine's first job, not in the table); the runs find it
        analysis = {"DALI_LOADER_ANALYSIS_CACHE": str(directory / "analysis-cache")}
        cold = measure(
            sys.executable,
            "pq-loader",
            "first-only",
            proxy,
            bucket,
            directory / "cold.state",
            args.limit,
            {"BENCH_ANCHORS_PLACE": "local", **analysis},
        )
        print(
            "  this loader's first job on a machine (no DALI analysis on disk yet), local: "
            + (f"first batch {cold.first_s:.1f} s" if cold.first_s else f"failed: {cold.error}"),
            flush=True,
        )
        contenders = CONTENDERS if args.anchors else OURS
        results: dict[str, dict[str, list[tuple[Any, Any]]]] = {p: {} for p in PLACES}
        order = list(contenders)
        for repeat in range(args.repeats):
            for place in PLACES:
                for name in order:
                    python = {"pq-litdata": args.anchors_python}.get(
                        name,
                        args.datasets_python if name.startswith("pq-datasets") else sys.executable,
                    )
                    extra = {"BENCH_ANCHORS_PLACE": place, **(analysis if name in OURS else {})}
                    state = directory / f"{name}.state"
                    first = measure(python, name, "first", proxy, bucket, state, args.limit, extra)
                    resume = (
                        measure(
                            python, name, "resume-epoch", proxy, bucket, state, args.limit, extra
                        )
                        if state.exists()
                        else None
                    )
                    if resume is not None:
                        seen_file = Path(f"{state}.seen.json")
                        seen = json.loads(seen_file.read_text()) if seen_file.exists() else []
                        resume.progress = [exactness(seen, resume.rest_ids, layout["samples"])]
                    for path in directory.glob(f"{name}.state*"):
                        path.unlink()
                    results[place].setdefault(name, []).append((first, resume))
                    print(f"  run {repeat + 1} {place} {name}: {brief(first, resume)}", flush=True)
            order = order[1:] + order[:1]
        for place in PLACES:
            print(f"\n{place}:" if place == "local" else "\nS3 (moto behind the counting proxy):")
            print(table(results[place], layout, remote=place == "s3"))
            print(targets(results[place]), flush=True)


def exactness(before: list[int], after: list[int], total: int) -> str:
    """Whether the ids delivered before the save and after the resume make every sample once:
    ``"exact"``, or how many came twice and how many never."""
    counts: dict[int, int] = {}
    for sample in (*before, *after):
        counts[sample] = counts.get(sample, 0) + 1
    twice = sum(c - 1 for c in counts.values() if c > 1)
    missing = total - len(counts)
    return "exact" if not twice and not missing else f"{twice} twice, {missing} missing"


def brief(first: Any, resume: Any) -> str:
    parts = [
        f"first {first.first_s:.1f} s" if first.first_s is not None else f"failed: {first.error}"
    ]
    if first.epoch_s:
        parts.append(f"epoch {first.epoch_samples / first.epoch_s:.0f} samples/s")
    if resume is None:
        parts.append("no state saved")
    elif resume.first_s is None:
        parts.append(f"resume failed: {resume.error}")
    else:
        parts.append(f"resume {resume.first_s:.1f} s, {resume.progress[0]}")
    return ", ".join(parts)


def _cells(runs: dict[str, list[tuple[Any, Any]]], pick: Any, form: str) -> list[str]:
    from bench.anchors import _span

    cells = []
    for pairs in runs.values():
        values = [v for v in (pick(f, r) for f, r in pairs) if v is not None]
        errors = [o.error for f, r in pairs for o in (f, r) if o is not None and o.error]
        cells.append(_span(values, form) if values or not errors else f"failed ({errors[0][:30]})")
    return cells


def table(runs: dict[str, list[tuple[Any, Any]]], layout: dict[str, Any], remote: bool) -> str:
    """One place's side-by-side table: each cell min-max over the runs."""

    def ok(outcome: Any) -> bool:
        return outcome is not None and outcome.first_s is not None

    rows: list[tuple[str, Any, str]] = [
        ("construct -> first batch, s", lambda f, r: f.first_s, "{:.2f}"),
        # (what a user waits for: the script's imports and its set-up too, the same for all)
        ("process start -> first batch, s", lambda f, r: f.started_s, "{:.2f}"),
        ("  the script's imports, s", lambda f, r: f.imported_s, "{:.2f}"),
    ]
    if remote:
        rows += [
            ("  requests before it", lambda f, r: f.first.requests if ok(f) else None, "{:d}"),
            (
                "  MB served before it",
                lambda f, r: f.first.bytes / 1e6 if ok(f) else None,
                "{:.2f}",
            ),
        ]
    rows += [
        (
            "epoch, samples/s",
            lambda f, r: f.epoch_samples / f.epoch_s if f.epoch_s else None,
            "{:.0f}",
        ),
    ]
    if remote:
        rows.append(
            (
                "  MB served in the epoch",
                lambda f, r: f.epoch.bytes / 1e6 if f.epoch_s else None,
                "{:.1f}",
            )
        )
    rows += [
        (
            "  every sample once",
            lambda f, r: (
                (f.epoch_unique == f.epoch_samples == layout["samples"]) if f.epoch_s else None
            ),
            "{}",
        ),
        (
            "resume: construct, load -> first batch, s",
            lambda f, r: r.first_s if ok(r) else None,
            "{:.2f}",
        ),
        (
            "resume: process start -> first batch, s",
            lambda f, r: r.started_s if ok(r) else None,
            "{:.2f}",
        ),
    ]
    if remote:
        rows += [
            ("  requests before it", lambda f, r: r.first.requests if ok(r) else None, "{:d}"),
            (
                "  MB served before it",
                lambda f, r: r.first.bytes / 1e6 if ok(r) else None,
                "{:.2f}",
            ),
        ]
    rows.append(
        ("  save + resume: every sample once", lambda f, r: r.progress[0] if ok(r) else None, "{}")
    )
    shown = []
    for label, pick, form in rows:
        cells = _cells(runs, pick, form)
        shown.append([label, *(c.replace("True", "yes").replace("False", "no") for c in cells)])
    columns = [H.Col("", left=True), *(H.Col(NAMES[n]) for n in runs)]
    return H.table(columns, shown)


#: The contenders that read in the files' order (the rest shuffle).
UNSHUFFLED = frozenset({"pq-loader-ordered", "pq-datasets-ordered", "pq-datasets-reshard-ordered"})


def targets(runs: dict[str, list[tuple[Any, Any]]]) -> str:
    """This loader against the best anchor (the best of each one's runs): first batch and resume
    (lower is better), epoch samples/s (higher is better); then like for like, each against the
    best anchor that orders as it does (shuffled against shuffled, unshuffled against
    unshuffled): a shuffle's first batch draws from many row groups, an unshuffled one from
    the first."""
    anchors = [n for n in runs if n not in OURS]
    if not anchors:
        return ""

    def best(names: list[str], pick: Any, lowest: bool) -> tuple[float, str] | None:
        found = [(v, n) for n in names for f, r in runs[n] if (v := pick(f, r)) is not None]
        return (min if lowest else max)(found) if found else None

    measures = (
        ("first batch", lambda f, r: f.first_s, True),
        ("resume", lambda f, r: r.first_s if r is not None else None, True),
        ("epoch samples/s", lambda f, r: f.epoch_samples / f.epoch_s if f.epoch_s else None, False),
    )

    def compared(alike: bool) -> list[str]:
        lines = []
        for label, pick, lowest in measures:
            for ours in (n for n in OURS if n in runs):
                same = [a for a in anchors if (a in UNSHUFFLED) == (ours in UNSHUFFLED)]
                theirs = best(same if alike else anchors, pick, lowest)
                mine = best([ours], pick, lowest)
                if theirs is None or mine is None:
                    continue
                lines.append(
                    f"  {NAMES[ours]} {label}: {mine[0]:.2f} / best anchor ({NAMES[theirs[1]]}) "
                    f"{theirs[0]:.2f} = {mine[0] / theirs[0]:.2f}x"
                )
        return lines

    return (
        "against the best anchor (target: first batch and resume <= 1x, epoch >= 0.95x):\n"
        + "\n".join(compared(False))
        + "\nlike for like (shuffled against the best shuffled anchor, unshuffled against the "
        "best unshuffled one):\n" + "\n".join(compared(True))
    )
