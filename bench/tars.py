"""``sharded_tars`` next to ``sharded_files``: ``python -m bench.tars [--rounds N]``; what a start
costs over an object store: ``python -m bench.tars --remote-scale [--shards 64,1024]``.

The images workload (decode, random resized crop 224, flip, normalize; batches of 64; the 512
sample images) through the loader, W=2, capture, over the same images kept four ways:

* ``sharded_files``: the ImageFolder, one file per image;
* ``tars local``: WebDataset shards of 64 images (``python -m loader.tars``), one permutation of
  the whole dataset, each sample one ``pread``;
* ``tars local w=2``: the same shards shuffled two at a time (the remote order, read locally);
* ``tars s3 w=2``: the same shards in an S3 bucket served by moto's server on 127.0.0.1 (a
  separate process), read through s3fs: per worker one ranged GET per shard, fetched ahead.

The contenders run in turn, ``--rounds`` times (the order rotating), and the table shows each
one's median batches/s, workers' CPU per batch (every worker process, all threads) and first
batch of an epoch, and its ratio to ``sharded_files`` in the same round.

``--remote-scale``: N small shards (4 samples of 2 kB each) in moto's S3 server (a process of
its own) behind a proxy that counts requests and bytes (:mod:`bench._s3`); for each N, what the
loader (2 workers, a cache that has never seen the bucket) serves and waits for before its first
batch: without any index (the workers scan every shard), the ``python -m loader.tars index``
run itself, and after it; and ``webdataset.WebDataset`` streaming the same shards over HTTP
(one process, its first batch of 4), for reference.

``--start-ratio N``: the first batch after the index command over ``--shards`` (48 and 1,024 by
default) in turn, N times each, side by side (:func:`bench.tars_remote.start_ratio`).

``--remote-epoch``: the bytes an epoch serves (:func:`bench.tars_remote.epoch_bytes`), 20
shards on 2 ranks of 1, 2 and 4 workers.
"""

from __future__ import annotations

import argparse
import functools
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import _harness as H
from bench import _sources as S
from bench.files import BATCH, Run, measure
from loader import Shard, ensure_sample_dataset, sharded_tars, write_tars

BUCKET = "bench-shards"


def tars_source(shard: Shard, urls: str, window: int | None, options: dict[str, Any] | None) -> Any:
    return sharded_tars(
        shard,
        urls,
        batch_size=BATCH,
        ext=("jpg", "cls"),
        shuffle_window=window,
        storage_options=options,
    )


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _serve(shards: list[Path]) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    """moto's S3 server in its own process, with ``shards`` uploaded."""
    import boto3

    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="bench",
        aws_secret_access_key="bench",
        region_name="us-east-1",
    )
    try:
        for _ in range(100):
            try:
                client.create_bucket(Bucket=BUCKET)
                break
            except Exception:  # not listening yet
                time.sleep(0.1)
        for path in shards:
            client.upload_file(str(path), BUCKET, path.name)
    finally:
        client.close()
    options = {
        "key": "bench",
        "secret": "bench",
        "endpoint_url": endpoint,
        "client_kwargs": {"region_name": "us-east-1"},
    }
    return server, options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=3, help="runs of every contender")
    parser.add_argument("--epochs", type=int, default=4, help="timed epochs per run")
    H.add_threads(parser)
    parser.add_argument(
        "--remote-scale", action="store_true", help="requests and bytes before the first batch"
    )
    parser.add_argument(
        "--shards",
        default=None,
        help="the dataset sizes, in shards (--remote-scale: 64,1024; --start-ratio: 48,1024)",
    )
    parser.add_argument(
        "--no-scan-above",
        type=int,
        default=1024,
        help="--remote-scale: skip the run without an index above this many shards",
    )
    parser.add_argument(
        "--remote-epoch", action="store_true", help="bytes served per epoch, per layout"
    )
    parser.add_argument(
        "--index-scale",
        action="store_true",
        help="python -m loader.tars index over N remote shards: requests and seconds",
    )
    parser.add_argument(
        "--index-args",
        default="",
        help="--index-scale: more arguments for the index command (e.g. '--threads 8')",
    )
    parser.add_argument(
        "--start-ratio", type=int, default=0, help="rounds of first batches, sizes side by side"
    )


def parser() -> argparse.ArgumentParser:
    return H.parser("tars", __doc__, add_arguments)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.start_ratio or args.remote_epoch or args.remote_scale or args.index_scale:
        from bench import tars_remote

        if args.index_scale:
            sizes = [int(n) for n in (args.shards or "1000").split(",")]
            tars_remote.index_scale(sizes, args.rounds, args.index_args.split())
        elif args.start_ratio:
            sizes = [int(n) for n in (args.shards or "48,1024").split(",")]
            tars_remote.start_ratio(sizes, args.start_ratio)
        elif args.remote_epoch:
            tars_remote.epoch_bytes()
        else:
            sizes = [int(n) for n in (args.shards or "64,1024").split(",")]
            tars_remote.main(sizes, args.no_scan_above)
        return
    root = str(ensure_sample_dataset())
    with tempfile.TemporaryDirectory() as directory:
        shards = write_tars(root, directory, samples_per_shard=64)
        local = f"{directory}/train-{{000000..{len(shards) - 1:06d}}}.tar"
        server, options = _serve(shards)
        try:
            remote = f"s3://{BUCKET}/train-{{000000..{len(shards) - 1:06d}}}.tar"
            sources = {
                "sharded_files": functools.partial(S.files_source, root=root, batch_size=BATCH),
                "tars local": functools.partial(tars_source, urls=local, window=None, options=None),
                "tars local w=2": functools.partial(
                    tars_source, urls=local, window=2, options=None
                ),
                "tars s3 w=2": functools.partial(
                    tars_source, urls=remote, window=2, options=options
                ),
            }
            found = compare(sources, args.rounds, args.epochs, H.threads(args.threads))
        finally:
            server.kill()
            server.wait()
    ratios = {name: H.ratios(found, name, "sharded_files", _rate) for name in found}
    print()
    H.print_table(
        [
            H.Col("contender", left=True),
            H.Col("batches/s", ".2f"),
            H.Col("vs files", ".2f"),
            H.Col("worker CPU ms/batch", ".1f"),
            H.Col("1st batch ms", ".0f"),
        ],
        [
            (
                name,
                statistics.median(t.value.batches_per_second for t in made),
                statistics.median(ratios[name]),
                statistics.median(t.value.worker_cpu_ms for t in made),
                statistics.median(t.value.first_batch_ms for t in made),
            )
            for name, made in found.items()
        ],
    )


def _rate(run: Run) -> float:
    return run.batches_per_second


def compare(
    sources: dict[str, Any], rounds: int, epochs: int, threads: int
) -> dict[str, list[H.Timed[Run]]]:
    """The loader over each of ``sources`` in turn, ``rounds`` times, the order rotating; a line
    per round."""

    def report(name: str, timed: H.Timed[Run]) -> None:
        line.append(f"{name} {timed.value.batches_per_second:.2f}")
        if len(line) == len(sources):
            print(f"round {timed.round}: " + ", ".join(line), flush=True)
            line.clear()

    line: list[str] = []
    return H.paired(
        {
            name: functools.partial(measure, source, epochs, threads)
            for name, source in sources.items()
        },
        rounds=rounds,
        order="rotate",
        report=report,
    )


if __name__ == "__main__":
    main()
