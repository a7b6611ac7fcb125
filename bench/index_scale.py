"""``python -m bench.index_scale``: the index command over many remote files, counted and timed.

For each format (``--format``: Parquet files, tar shards, or both) and each count (``--files``,
10,000 by default), that many small files go to a bucket of moto's S3 server (a process of its
own); ``python -m loader index`` then indexes them through :class:`bench._s3.CountingProxy`, in a
process of its own with an empty node cache, as a user runs it once per dataset. Each row: the
command's wall time, its CPU (all its threads), the S3 server's CPU over the same time, the
requests and bytes the proxy served, and the wall time per file. The target (issue: "10,000 files
in at most 60 s on the same server") is read off the ``seconds`` column.

Then, for Parquet, one start of the loader over the indexed bucket (:mod:`bench._index_start`:
``ParquetDataset`` of the label and id columns, 2 workers, an empty node cache): construct ->
first batch, the requests before it (a constant with the summary, whatever the number of files),
and the trainer's and each worker's resident memory at that moment.

The Parquet files are written as ``datasets`` writes them (an ``Image`` struct column, a
``ClassLabel`` of 1,000 names and an ``id``, the ``huggingface`` schema metadata and pyarrow's
Arrow schema in the footer, no statistics for the image column; two row groups of two rows
each); the tar shards are those of
:mod:`bench.tars_remote` (4 samples of 2 kB each, with ``.cls`` and ``.id``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench import _harness as H
from bench._s3 import CountingProxy, S3Server

ROWS, ROW_GROUP, PAYLOAD = 4, 2, 2000
FORMATS = ("parquet", "tars")


def write_parquet(directory: Path, files: int) -> list[Path]:
    """``files`` Parquet files of ``ROWS`` rows in row groups of ``ROW_GROUP``, with the columns
    and footer metadata ``datasets``' ``to_parquet`` writes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    features = {
        "image": {"_type": "Image"},
        "label": {"names": [f"n{k:08d}" for k in range(1000)], "_type": "ClassLabel"},
        "id": {"dtype": "int64", "_type": "Value"},
    }
    metadata = {b"huggingface": json.dumps({"info": {"features": features}}).encode()}
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema(
        [("image", image), ("label", pa.int64()), ("id", pa.int64())], metadata=metadata
    )
    payload = os.urandom(PAYLOAD)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for number in range(files):
        ids = list(range(number * ROWS, (number + 1) * ROWS))
        table = pa.table(
            {
                "image": pa.array([{"bytes": payload, "path": None} for _ in ids], image),
                "label": pa.array([i % 1000 for i in ids], pa.int64()),
                "id": pa.array(ids, pa.int64()),
            },
            schema=schema,
        )
        path = directory / f"train-{number:06d}.parquet"
        pq.write_table(table, path, row_group_size=ROW_GROUP, write_statistics=["label", "id"])
        paths.append(path)
    return paths


def write_tars(directory: Path, files: int) -> list[Path]:
    from tests.tar_pipelines import write_payload_tars

    return write_payload_tars(directory, files, ROWS, PAYLOAD, digits=6)


def upload(server: S3Server, paths: list[Path], bucket: str, prefix: str) -> None:
    client = server.client()
    try:
        with ThreadPoolExecutor(16) as pool:
            list(
                pool.map(lambda p: client.upload_file(str(p), bucket, f"{prefix}/{p.name}"), paths)
            )
    finally:
        client.close()


def cpu_of(pid: int) -> float:
    """The CPU seconds (user and system) process ``pid`` has used so far."""
    with open(f"/proc/{pid}/stat") as file:
        fields = file.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def index(
    url: str, options: dict[str, Any], cache: Path, server_pid: int, proxy: CountingProxy
) -> dict[str, Any]:
    """``python -m loader index url`` in a process of its own: seconds, its CPU, the server's CPU,
    requests and MB served; the command's last line."""
    proxy.reset()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    server_cpu = cpu_of(server_pid)
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "loader",
            "index",
            url,
            "--storage-options",
            json.dumps(options),
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, DALI_LOADER_CACHE_DIR=str(cache)),
    )
    seconds = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    requests, served = proxy.count()
    lines = (done.stdout + done.stderr).strip().splitlines()
    return {
        "seconds": seconds,
        "cpu": (after.ru_utime + after.ru_stime) - (children.ru_utime + children.ru_stime),
        "server_cpu": cpu_of(server_pid) - server_cpu,
        "requests": requests,
        "mb": served / 1e6,
        "ok": done.returncode == 0,
        "last": lines[-1] if lines else "",
    }


def parser() -> argparse.ArgumentParser:
    return H.parser("index_scale", __doc__, add_arguments)


def start(
    url: str, server: S3Server, proxy: CountingProxy, root: Path, count: int
) -> dict[str, Any]:
    """One start of the loader over ``url`` (:mod:`bench._index_start`): what it said, and the
    requests served before its first batch."""
    proxy.reset()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench._index_start",
            url,
            json.dumps(server.options(proxy.endpoint)),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, DALI_LOADER_CACHE_DIR=str(root / f"start-cache-{count}")),
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert process.stdin is not None and process.stdout is not None
    line = process.stdout.readline()
    said: dict[str, Any] = json.loads(line) if line.strip() else {}
    served = proxy.records()
    said["requests"] = len(served)
    said["of_files"] = sum(1 for s in served if s.path.endswith(".parquet"))
    process.stdin.write("\n")
    process.stdin.flush()
    process.wait(timeout=120)
    return said


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    server = S3Server(threaded=False)
    proxy = CountingProxy(server.endpoint)
    process = server._process
    assert process is not None
    rows = []
    starts: list[tuple[int, dict[str, Any]]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="index-scale-") as temporary:
            root = Path(temporary)
            for count in args.files:
                for fmt in args.format:
                    bucket = f"index-{fmt}-{count}"
                    server.bucket(bucket)
                    write = write_parquet if fmt == "parquet" else write_tars
                    paths = write(root / f"{fmt}-{count}", count)
                    upload(server, paths, bucket, "train")
                    found = index(
                        f"s3://{bucket}/train/",
                        server.options(proxy.endpoint),
                        root / f"cache-{fmt}-{count}",
                        process.pid,
                        proxy,
                    )
                    print(
                        f"  {fmt} x {count}: {found['seconds']:.1f} s, {found['requests']} requests"
                        + ("" if found["ok"] else f": FAILED: {found['last']}"),
                        flush=True,
                    )
                    rows.append((fmt, count, found))
                    if fmt == "parquet" and found["ok"]:
                        starts.append(
                            (count, start(f"s3://{bucket}/train/", server, proxy, root, count))
                        )
    finally:
        proxy.close()
        server.close()
    print(
        f"\n{'format':8s} {'files':>7s} {'seconds':>8s} {'ms/file':>8s} {'its CPU, s':>11s} "
        f"{'S3 server CPU, s':>17s} {'requests':>9s} {'MB served':>10s}"
    )
    for fmt, count, found in rows:
        print(
            f"{fmt:8s} {count:7d} {found['seconds']:8.1f} {found['seconds'] / count * 1e3:8.2f} "
            f"{found['cpu']:11.1f} {found['server_cpu']:17.1f} {found['requests']:9d} "
            f"{found['mb']:10.1f}"
        )
    print("\ntarget: 10,000 files of either format in at most 60 s")
    if starts:
        print(
            f"\n{'Parquet, indexed':16s} {'construct -> first batch, s':>28s} "
            f"{'requests before it':>19s} {'of them other than the files':>29s} "
            f"{'trainer MB':>11s} {'each worker MB':>15s}"
        )
        for count, said in starts:
            workers = "/".join(str(m) for m in said.get("workers_rss_mb", [])) or "-"
            print(
                f"{count:>7d} files    {said.get('first', float('nan')):>28.2f} "
                f"{said.get('requests', 0):>19d} "
                f"{said.get('requests', 0) - said.get('of_files', 0):>29d} "
                f"{said.get('rss_mb', 0):>11.0f} {workers:>15s}"
            )
        print(
            "(the requests of the files are the row groups the first batches read, and those "
            "read ahead: batches of 32 rows from row groups of 2)"
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--files", type=int, nargs="+", default=[10000], help="files of each format (each a run)"
    )
    parser.add_argument(
        "--format", nargs="+", choices=FORMATS, default=list(FORMATS), help="which formats"
    )


if __name__ == "__main__":
    main()
