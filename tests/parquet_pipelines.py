"""Pipelines and data of the Parquet tests (workers import them by module): Parquet files written
by Hugging Face ``datasets`` itself, with an ``Image`` and a ``ClassLabel`` column."""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import nvidia.dali.experimental.dynamic as ndd

from loader import Shard, sharded_parquet

#: Classes of the ClassLabel column.
NAMES = ["cat", "dog", "fox"]


def jpeg(value: int, size: int = 8) -> bytes:
    """A small JPEG whose red channel is ``value % 256``."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (size, size), (value % 256, 40, 80)).save(out, "JPEG", quality=95)
    return out.getvalue()


def hf_dataset(ids: Sequence[int], *, null_image: frozenset[int] = frozenset()) -> Any:
    """A ``datasets.Dataset`` of rows ``ids``: ``image`` (an ``Image``: a JPEG of the id),
    ``label`` (a ``ClassLabel``: id % 3) and ``id``."""
    import datasets

    features = datasets.Features(
        {
            "image": datasets.Image(),
            "label": datasets.ClassLabel(names=NAMES),
            "id": datasets.Value("int64"),
        }
    )
    rows = {
        "image": [None if i in null_image else {"bytes": jpeg(i), "path": None} for i in ids],
        "label": [i % 3 for i in ids],
        "id": list(ids),
    }
    return datasets.Dataset.from_dict(rows, features=features)


def write_parquet(
    directory: Path,
    sizes: Sequence[int],
    row_group: int,
    *,
    prefix: str = "train",
    null_image: frozenset[int] = frozenset(),
) -> list[Path]:
    """Files of ``sizes`` rows each (ids numbered across them), written by ``datasets``'
    ``to_parquet`` in row groups of ``row_group`` rows."""
    directory.mkdir(parents=True, exist_ok=True)
    paths, first = [], 0
    for number, size in enumerate(sizes):
        path = directory / f"{prefix}-{number:05d}.parquet"
        dataset = hf_dataset(range(first, first + size), null_image=null_image)
        dataset.to_parquet(str(path), batch_size=row_group)
        paths.append(path)
        first += size
    return paths


def id_parquet(
    shard: Shard,
    urls: Any,
    batch_size: int = 4,
    shuffle_window: int | None = None,
    storage_options: dict[str, Any] | None = None,
    columns: tuple[str, ...] = ("label", "id"),
) -> Any:
    return sharded_parquet(
        shard,
        urls,
        batch_size=batch_size,
        columns=columns,
        shuffle_window=shuffle_window,
        storage_options=storage_options,
    )


def image_parquet(
    shard: Shard, urls: Any, batch_size: int = 4, storage_options: dict[str, Any] | None = None
) -> Any:
    return sharded_parquet(
        shard,
        urls,
        batch_size=batch_size,
        columns=("image", "label", "id"),
        storage_options=storage_options,
    )


def label_id_step(label: Any, ids: Any) -> dict[str, Any]:
    return {"label": ndd.cast(label, dtype=ndd.int64), "id": ndd.cast(ids, dtype=ndd.int64)}


def decode_step(jpegs: Any, label: Any, ids: Any) -> dict[str, Any]:
    images = ndd.decoders.image(jpegs, device="cpu")
    return {
        "image": images,
        "label": ndd.cast(label, dtype=ndd.int64),
        "id": ndd.cast(ids, dtype=ndd.int64),
    }


def saved_dataset(directory: Path, rows: int, shard_bytes: int = 20_000) -> Any:
    """A ``datasets.Dataset`` of ``rows`` rows saved to ``directory`` in several Arrow files and
    loaded back (memory-mapped)."""
    import datasets

    hf_dataset(range(rows)).save_to_disk(str(directory), max_shard_size=shard_bytes)
    return datasets.load_from_disk(str(directory))


def write_captioned(directory: Path, rows: int, null_caption: frozenset[int]) -> Path:
    """One file written by ``datasets``: ``image`` (an ``Image``), ``caption`` (a string; null at
    the ids ``null_caption``) and ``id``, in row groups of 10 rows."""
    import datasets

    features = datasets.Features(
        {
            "image": datasets.Image(),
            "caption": datasets.Value("string"),
            "id": datasets.Value("int64"),
        }
    )
    table = {
        "image": [{"bytes": jpeg(i), "path": None} for i in range(rows)],
        "caption": [None if i in null_caption else f"a photo nº{i}" for i in range(rows)],
        "id": list(range(rows)),
    }
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "captioned.parquet"
    datasets.Dataset.from_dict(table, features=features).to_parquet(str(path), batch_size=10)
    return path


def caption_step(jpegs: Any, caption: Any, ids: Any) -> dict[str, Any]:
    """The images decoded; captions (UTF-8 bytes) and ids as they are."""
    images = ndd.decoders.image(jpegs, device="cpu")
    return {"image": images, "caption": caption, "id": ndd.cast(ids, dtype=ndd.int64)}


def bytes_step(jpegs: Any, ids: Any) -> dict[str, Any]:
    """The image column's bytes as they are (not decoded), and the ids."""
    return {"image": jpegs, "id": ndd.cast(ids, dtype=ndd.int64)}


def one_output_step(values: Any) -> dict[str, Any]:
    """The one column's (or member's) samples as they come."""
    return {"value": values}
