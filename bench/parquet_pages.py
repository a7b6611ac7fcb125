"""``python -m bench.parquet_pages``: large Parquet row groups shared between workers and ranks,
read by their pages (the files' page index) and whole, side by side in one run.

The files are written by ``datasets`` itself with its defaults (``to_parquet``: one row group per
file up to 100 MB, a page index, the image column plain and uncompressed in content-defined pages
of 256 KB-1 MB): ``--files`` files of ``--rows`` rows, each image ``--kb`` KB of random bytes
(not decoded: the step passes the bytes through, so that the table measures reading). For each
layout (``--layouts``, ranks x workers; ranks run one after another in this process, each a
``Loader(rank=r, world_size=R)``) and each way of reading (``page_index`` True and False), one
epoch: its seconds (every rank's, added), the bytes and requests the workers read (``stats()``,
all ranks), and those as a share of the requested columns' chunks (1.00x: each rank read only its
share). Then a resume: each rank's state after a third of its steps, resumed on the same layout,
and the bytes read to finish the epoch. ``--s3`` reads from moto's S3 server on 127.0.0.1 instead
of the local disk (the proxy's count of every byte served, both runs and the footers, is
printed beside the workers' own).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import _harness as H

COLUMNS = ("image", "id")


def write(directory: Path, files: int, rows: int, kb: int) -> list[Path]:
    """``files`` files of ``rows`` rows written by ``datasets``' ``to_parquet`` (its defaults)."""
    import datasets

    features = datasets.Features({"image": datasets.Image(), "id": datasets.Value("int64")})
    rng = np.random.default_rng(0)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for number in range(files):
        ids = range(number * rows, (number + 1) * rows)
        table = {
            "image": [{"bytes": rng.bytes(kb * 1000), "path": None} for _ in ids],
            "id": list(ids),
        }
        path = directory / f"train-{number:05d}.parquet"
        datasets.Dataset.from_dict(table, features=features).to_parquet(str(path))
        paths.append(path)
    return paths


def chunk_bytes(paths: list[Path]) -> int:
    """The bytes of the requested columns' chunks in ``paths``."""
    import pyarrow.parquet as pq

    total = 0
    for path in paths:
        meta = pq.ParquetFile(path).metadata
        for group in range(meta.num_row_groups):
            for k in range(meta.num_columns):
                column = meta.row_group(group).column(k)
                if column.path_in_schema.split(".")[0] in COLUMNS:
                    total += column.total_compressed_size
    return total


def step(images: Any, ids: Any) -> dict[str, Any]:
    """The image bytes as they are, and the ids (the workers import it from here)."""
    import nvidia.dali.experimental.dynamic as ndd

    return {"image": images, "id": ndd.cast(ids, dtype=ndd.int64)}


def loaders(
    urls: str, options: dict[str, Any] | None, ranks: int, workers: int, page_index: bool
) -> list[Any]:
    from loader import Loader, ParquetDataset

    dataset = ParquetDataset(urls, columns=COLUMNS, storage_options=options, page_index=page_index)
    return [
        Loader(dataset, step, batch_size=16, num_workers=workers, rank=r, world_size=ranks)
        for r in range(ranks)
    ]


def epoch(urls: str, options: dict[str, Any] | None, layout: tuple[int, int], pages: bool) -> Any:
    """One epoch of every rank, then a resume of each from a third of its steps: (seconds,
    bytes, requests, rows, bytes read resuming)."""
    ranks, workers = layout
    seconds = nbytes = requests = rows = 0.0
    states = []
    for loader in loaders(urls, options, ranks, workers, pages):
        with loader:
            started = time.perf_counter()
            count = 0
            for batch in loader:
                count += len(batch["id"]) - batch.info.padded
            seconds += time.perf_counter() - started
            stats = loader.stats()
            nbytes, requests, rows = (
                nbytes + stats.bytes_read,
                requests + stats.read_requests,
                rows + count,
            )
            iterator = iter(loader)
            for _ in range(len(loader) // 3):
                next(iterator)
            states.append(json.loads(json.dumps(loader.state_dict())))
    again = 0
    for loader, state in zip(loaders(urls, options, ranks, workers, pages), states, strict=True):
        with loader:
            loader.load_state_dict(state)
            for _batch in loader:
                pass
            again += loader.stats().bytes_read
    return seconds, nbytes, requests, rows, again


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--files", type=int, default=2, help="Parquet files (one row group each)")
    parser.add_argument("--rows", type=int, default=1500, help="rows per file")
    parser.add_argument("--kb", type=int, default=20, help="KB per image")
    parser.add_argument(
        "--layouts",
        nargs="+",
        default=["1x4", "2x2", "4x2"],
        help="ranks x workers, e.g. 2x2",
    )
    parser.add_argument("--s3", action="store_true", help="read from moto's S3 server")


def parser() -> argparse.ArgumentParser:
    return H.parser("parquet_pages", __doc__, add_arguments)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    layouts = [tuple(int(n) for n in text.split("x")) for text in args.layouts]
    with tempfile.TemporaryDirectory(prefix="parquet-pages-") as temporary:
        paths = write(Path(temporary) / "data", args.files, args.rows, args.kb)
        chunks = chunk_bytes(paths)
        urls, options, server, proxy = str(Path(temporary) / "data"), None, None, None
        if args.s3:
            from bench._s3 import CountingProxy, S3Server

            server = S3Server(threaded=False)
            proxy = CountingProxy(server.endpoint)
            server.bucket("pages")
            client = server.client()
            for path in paths:
                client.upload_file(str(path), "pages", path.name)
            client.close()
            urls, options = "s3://pages", server.options(proxy.endpoint)
        print(
            f"{args.files} files x 1 row group x {args.rows} rows, {chunks / 1e6:.1f} MB of "
            f"requested chunks, {'S3 (moto)' if args.s3 else 'local'}; {H.load_average()}",
            flush=True,
        )
        found = []
        try:
            for layout in layouts:
                for pages in (True, False):
                    if proxy is not None:
                        proxy.reset()
                    seconds, nbytes, requests, rows, again = epoch(urls, options, layout, pages)
                    served = proxy.count()[1] if proxy is not None else None
                    found.append(
                        (
                            f"{layout[0]}x{layout[1]}",
                            "pages" if pages else "whole",
                            seconds,
                            rows / seconds,
                            nbytes / 1e6,
                            H.ratio(nbytes, chunks),
                            int(requests),
                            again / 1e6,
                            None if served is None else served / 1e6,
                        )
                    )
        finally:
            if proxy is not None and server is not None:
                proxy.close()
                server.close()
    H.print_table(
        [
            H.Col("ranks x workers", left=True),
            H.Col("reads", left=True),
            H.Col("epoch s", ".2f"),
            H.Col("samples/s", ",.0f"),
            H.Col("epoch MB", ".1f"),
            H.Col("of chunks"),
            H.Col("requests", ","),
            H.Col("resume MB", ".1f"),
            H.Col("served MB (both runs)", ".1f"),
        ],
        found,
    )


if __name__ == "__main__":
    main()
