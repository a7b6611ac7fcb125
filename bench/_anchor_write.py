"""The bench's samples in the anchors' formats (run in the anchors' environment).

``python -m bench._anchor_write litdata|mds TARS OUT PER_SHARD``: reads the tar shards of
:func:`bench.anchors.write_tars` in order and writes the same samples, in the same order, as
LitData chunks of ``PER_SHARD`` samples (``litdata.optimize``, one process: chunks in order) or as
MDS shards of about ``PER_SHARD`` samples (``MDSWriter`` cuts shards by bytes, so the count is
near, not equal). Each sample: ``image`` (the JPEG's bytes), ``cls`` and ``id`` (ints).
``python -m bench._anchor_write litdata-parquet URL OPTIONS 0``: LitData's index of a directory
of Parquet files (:mod:`bench._anchor_parquet`; ``OPTIONS``: s3fs's storage options as JSON).
"""

from __future__ import annotations

import json
import sys
import tarfile
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def samples(path: str) -> Iterator[dict[str, Any]]:
    """One tar shard's samples, in order."""
    current: dict[str, Any] = {}
    key = None
    with tarfile.open(path) as tar:
        for member in tar:
            stem, _, ext = member.name.rpartition(".")
            if stem != key and current:
                yield current
                current = {}
            key = stem
            file = tar.extractfile(member)
            assert file is not None
            data = file.read()
            current["image" if ext == "jpg" else ext] = data if ext == "jpg" else int(data)
    if current:
        yield current


def write_litdata(tars: list[str], out: str, per_shard: int) -> None:
    from litdata import optimize

    optimize(
        fn=samples,
        inputs=tars,
        output_dir=out,
        chunk_size=per_shard,
        num_workers=1,
        reorder_files=False,
        verbose=False,
    )


def write_mds(tars: list[str], out: str, per_shard: int) -> None:
    sys.modules.setdefault("streaming.vision", types.ModuleType("streaming.vision"))
    from streaming import MDSWriter

    first = list(samples(tars[0]))
    mean = sum(len(s["image"]) for s in first) / len(first)
    # (MDS: 4 bytes of offset, 4 of the bytes column's size, 8 + 8 of the ints per sample)
    limit = int(per_shard * (mean + 24) + 64)
    columns = {"image": "bytes", "cls": "int", "id": "int"}
    with MDSWriter(out=out, columns=columns, size_limit=limit) as writer:
        for path in tars:
            for sample in samples(path):
                writer.write(sample)


def index_litdata_parquet(url: str, options: str) -> None:
    """LitData's index of a directory of Parquet files (its ``index.json``): written beside a
    local directory, uploaded into the bucket for an ``s3://`` one (as LitData does)."""
    from litdata import index_parquet_dataset

    index_parquet_dataset(url.rstrip("/"), storage_options=json.loads(options) or None)


def main(argv: list[str]) -> None:
    fmt, tars_dir, out, per_shard = argv
    if fmt == "litdata-parquet":  # (tars_dir: the files' place; out: storage options as JSON)
        index_litdata_parquet(tars_dir, out)
        return
    tars = [str(p) for p in sorted(Path(tars_dir).glob("*.tar"))]
    {"litdata": write_litdata, "mds": write_mds}[fmt](tars, out, int(per_shard))


if __name__ == "__main__":
    main(sys.argv[1:])
