"""``python -m bench.tars --remote-scale``: what a start costs over an object store, counted.

For each dataset size, N shards of 4 samples (2 kB each, plus ``.cls`` and ``.id``) go to a bucket
of their own in moto's S3 server (a process of its own); clients reach it through
:class:`bench._s3.CountingProxy`. Each row is one run, from a cold start (a bucket that no cache
has seen; the worker server already up, as after a job's first loader) to the first batch:
requests served, bytes served (and their share of the dataset) and seconds.

* ``no index``: the shards alone; the loader's workers scan them all (each shard once,
  shared out), write each ``.idx`` beside its shard and the summary;
* ``index command``: ``python -m loader.tars index`` (2 processes) over the same shards (whole);
* ``after index``: the loader again, once the index command has run (another bucket, the same
  shards);
* ``webdataset``: ``webdataset.WebDataset`` streaming the shards over HTTP (``curl``, one
  process), up to its first 4 samples: no index, no epoch plan, no exactly-once guarantee.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import nvidia.dali.experimental.dynamic as ndd

from bench import _harness as H
from bench._s3 import CountingProxy, S3Server
from loader import Loader, Shard, sharded_tars
from tests.tar_pipelines import write_payload_tars

SAMPLES, PAYLOAD = 4, 2000


def source(shard: Shard, urls: str, options: dict[str, Any]) -> Any:
    return sharded_tars(shard, urls, batch_size=4, ext=("cls", "id"), storage_options=options)


def step(cls: Any, ids: Any) -> dict[str, Any]:
    return {"cls": ndd.cast(cls, dtype=ndd.int64), "id": ndd.cast(ids, dtype=ndd.int64)}


def write_shards(directory: Path, count: int) -> list[Path]:
    return write_payload_tars(directory, count, SAMPLES, PAYLOAD, digits=6)


def upload(server: S3Server, bucket: str, paths: list[Path]) -> None:
    server.bucket(bucket)
    client = server.client()
    try:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda p: client.upload_file(str(p), bucket, p.name), paths))
    finally:
        client.close()


def first_batch(proxy: CountingProxy, urls: str, options: dict[str, Any]) -> tuple[int, int, float]:
    proxy.reset()
    started = time.monotonic()
    run = functools.partial(source, urls=urls, options=options)
    with Loader(run, step, batch_size=4, num_workers=2, copy=True) as loader:
        next(iter(loader))
        seconds = time.monotonic() - started
        requests, served = proxy.count()
    return requests, served, seconds


def index_command(
    proxy: CountingProxy, urls: str, options: dict[str, Any], extra: list[str] | None = None
) -> tuple[int, int, float]:
    proxy.reset()
    started = time.monotonic()
    command = [sys.executable, "-m", "loader.tars", "index", urls, *(extra or [])]
    subprocess.run(
        [*command, "--storage-options", json.dumps(options)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    seconds = time.monotonic() - started
    requests, served = proxy.count()
    return requests, served, seconds


def webdataset_first(
    proxy: CountingProxy, server: S3Server, bucket: str, count: int
) -> tuple[int, int, float] | None:
    try:
        import webdataset as wds
    except ImportError:
        return None
    client = server.client(proxy.endpoint)
    try:  # (signed URLs: the objects are private)
        urls = [
            "pipe:curl -s '"
            + client.generate_presigned_url(
                "get_object", Params={"Bucket": bucket, "Key": f"train-{number:06d}.tar"}
            )
            + "'"
            for number in range(count)
        ]
    finally:
        client.close()
    proxy.reset()
    started = time.monotonic()
    dataset = wds.WebDataset(urls, shardshuffle=False, empty_check=False).to_tuple("cls", "id")
    batch = []
    for sample in dataset:
        batch.append(sample)
        if len(batch) == 4:
            break
    seconds = time.monotonic() - started
    del dataset
    requests, served = proxy.count()
    return requests, served, seconds


def index_scale(sizes: list[int], rounds: int, extra: list[str]) -> None:
    """``python -m loader.tars index`` (its defaults, and ``extra`` arguments) over N shards
    never indexed, each run over a bucket of its own (a fresh copy of the same shards): the
    requests the store served and the seconds, ``rounds`` runs per size."""
    server = S3Server(threaded=False)
    proxy = CountingProxy(server.endpoint)
    options = server.options(proxy.endpoint)
    rows = []
    try:
        with tempfile.TemporaryDirectory() as directory:
            for count in sizes:
                paths = write_shards(Path(directory) / str(count), count)
                pattern = f"train-{{000000..{count - 1:06d}}}.tar"
                for run in range(rounds):
                    bucket = f"index-{count}-{run}"
                    upload(server, bucket, paths)
                    requests, _served, seconds = index_command(
                        proxy, f"s3://{bucket}/{pattern}", options, extra
                    )
                    rows.append((count, run + 1, requests, seconds, count / seconds))
    finally:
        proxy.close()
        server.close()
    print(f"python -m loader.tars index {' '.join(extra)}".rstrip())
    H.print_table(
        [
            H.Col("shards"),
            H.Col("run"),
            H.Col("requests"),
            H.Col("seconds", ".1f"),
            H.Col("shards/s", ".0f"),
        ],
        rows,
    )


def epoch_bytes(shards: int = 20, per_shard: int = 40, payload: int = 8000) -> None:
    """What one epoch serves, as a share of the dataset: ``shards`` shards of ``per_shard``
    samples (``payload`` bytes each, plus ``.cls`` and ``.id``) indexed by the index command,
    read by 2 ranks (one after the other) of 1, 2 and 4 workers. Each rank runs two epochs; the
    row counts the bytes served during its second one (the first also fills the cache, and
    either epoch's workers fetch the next epoch's first shards ahead of it)."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-tars-cache-") as cache:
        os.environ["DALI_LOADER_CACHE_DIR"] = cache
        server = S3Server(threaded=False)
        proxy = CountingProxy(server.endpoint)
        options = server.options(proxy.endpoint)
        try:
            with tempfile.TemporaryDirectory() as directory:
                paths = write_payload_tars(Path(directory), shards, per_shard, payload)
                size = sum(p.stat().st_size for p in paths)
                upload(server, "epoch", paths)
                urls = f"s3://epoch/train-{{0000..{shards - 1:04d}}}.tar"
                index_command(proxy, urls, options)
                for workers in (1, 2, 4):
                    served, requests = _two_ranks(proxy, urls, options, workers)
                    rows.append((2, workers, served / 1e6, served / size, requests))
        finally:
            proxy.close()
            server.close()
    H.print_table(
        [
            H.Col("ranks"),
            H.Col("workers"),
            H.Col("MB/epoch", ".2f"),
            H.Col("of data", ".1%"),
            H.Col("requests"),
        ],
        rows,
    )


def _two_ranks(
    proxy: CountingProxy, urls: str, options: dict[str, Any], workers: int
) -> tuple[int, int]:
    """(bytes, requests) of shards served during each rank's second epoch, summed."""
    served = requests = 0
    run = functools.partial(source, urls=urls, options=options)
    for rank in range(2):
        with Loader(
            run, step, batch_size=4, num_workers=workers, rank=rank, world_size=2, copy=True
        ) as loader:
            for _batch in loader:
                pass
            before = _tar_reads(proxy)
            for _batch in loader:
                pass
            after = _tar_reads(proxy)
        served += after[0] - before[0]
        requests += after[1] - before[1]
    return served, requests


def _tar_reads(proxy: CountingProxy) -> tuple[int, int]:
    reads = [s for s in proxy.records() if s.name.endswith(".tar")]
    return sum(s.bytes for s in reads), len(reads)


def start_ratio(sizes: list[int], rounds: int) -> None:
    """Seconds from ``Loader(...)`` to the first batch after the index command, for each size
    in turn, ``rounds`` times (each start with a cache directory of its own, as a new node's),
    side by side: the medians and their ratio to the first size's."""
    server = S3Server(threaded=False)
    proxy = CountingProxy(server.endpoint)
    options = server.options(proxy.endpoint)
    try:
        with tempfile.TemporaryDirectory() as directory:
            os.environ["DALI_LOADER_CACHE_DIR"] = f"{directory}/cache-warm-up"
            (Path(directory) / "warm-up").mkdir()
            upload(server, "warm-up", write_shards(Path(directory) / "warm-up", 2))
            first_batch(proxy, "s3://warm-up/train-{000000..000001}.tar", options)
            urls = {}
            for count in sizes:
                (Path(directory) / str(count)).mkdir()
                upload(server, f"ratio-{count}", write_shards(Path(directory) / str(count), count))
                urls[count] = f"s3://ratio-{count}/train-{{000000..{count - 1:06d}}}.tar"
                index_command(proxy, urls[count], options)
            starts = iter(range(rounds * len(sizes)))

            def start(count: int) -> float:
                round_ = next(starts) // len(sizes)
                os.environ["DALI_LOADER_CACHE_DIR"] = f"{directory}/cache-{round_}-{count}"
                return first_batch(proxy, urls[count], options)[2]

            found = H.paired(
                {str(count): functools.partial(start, count) for count in sizes},
                rounds=rounds,
                order="fixed",
            )
            times = {count: [t.value for t in found[str(count)]] for count in sizes}
    finally:
        proxy.close()
        server.close()
    base = statistics.median(times[sizes[0]])
    H.print_table(
        [
            H.Col("shards"),
            H.Col("median s", ".2f"),
            H.Col("ratio", ".2f"),
            H.Col("runs", left=True),
        ],
        [
            (
                count,
                statistics.median(times[count]),
                statistics.median(times[count]) / base,
                H.runs(times[count]),
            )
            for count in sizes
        ],
    )


def main(sizes: list[int], no_scan_above: int) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-tars-cache-") as cache:
        os.environ["DALI_LOADER_CACHE_DIR"] = cache  # (not the user's: removed after)
        _measure(sizes, no_scan_above)


def _measure(sizes: list[int], no_scan_above: int) -> None:
    server = S3Server(threaded=False)
    proxy = CountingProxy(server.endpoint)
    options = server.options(proxy.endpoint)
    rows: list[tuple[int, str, tuple[int, int, float], int]] = []
    try:
        with tempfile.TemporaryDirectory() as directory:
            # (a first loader starts the worker server: not what a start over N shards costs)
            (Path(directory) / "warm-up").mkdir()
            upload(server, "warm-up", write_shards(Path(directory) / "warm-up", 2))
            first_batch(proxy, "s3://warm-up/train-{000000..000001}.tar", options)
            for count in sizes:
                (Path(directory) / str(count)).mkdir()
                paths = write_shards(Path(directory) / str(count), count)
                size = sum(p.stat().st_size for p in paths)
                pattern = f"train-{{000000..{count - 1:06d}}}.tar"
                if count <= no_scan_above:
                    bucket = f"noindex-{count}"
                    upload(server, bucket, paths)
                    measured = first_batch(proxy, f"s3://{bucket}/{pattern}", options)
                    rows.append((count, "no index", measured, size))
                bucket = f"indexed-{count}"
                upload(server, bucket, paths)
                extra = ["--workers", "2"]
                measured = index_command(proxy, f"s3://{bucket}/{pattern}", options, extra)
                rows.append((count, "index command", measured, size))
                measured = first_batch(proxy, f"s3://{bucket}/{pattern}", options)
                rows.append((count, "after index", measured, size))
                streamed = webdataset_first(proxy, server, bucket, count)
                if streamed is not None:
                    rows.append((count, "webdataset", streamed, size))
    finally:
        proxy.close()
        server.close()
    print()
    H.print_table(
        [
            H.Col("shards"),
            H.Col("run", left=True),
            H.Col("requests"),
            H.Col("MB", ".2f"),
            H.Col("of data", ".1%"),
            H.Col("seconds", ".1f"),
        ],
        [
            (count, name, requests, served / 1e6, served / size, seconds)
            for count, name, (requests, served, seconds), size in rows
        ],
    )
