"""Pipelines and data of the tar-shard tests (workers import them by module)."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Any

import nvidia.dali.experimental.dynamic as ndd

from loader import Shard, sharded_tars


def write_id_tars(
    directory: Path,
    total: int,
    per_shard: int,
    *,
    skip_cls: frozenset[int] = frozenset(),
    prefix: str = "train",
) -> list[Path]:
    """Tar shards of ``total`` samples, ``per_shard`` each: sample ``i`` is ``<key>.cls``
    (``i % 3``) and ``<key>.id`` (``i``); samples in ``skip_cls`` have no ``.cls``."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for number, first in enumerate(range(0, total, per_shard)):
        path = directory / f"{prefix}-{number:03d}.tar"
        with tarfile.open(path, "w") as tar:
            for sample in range(first, min(total, first + per_shard)):
                key = f"group{sample % 2}/s{sample:05d}"
                members = {"id": str(sample)}
                if sample not in skip_cls:
                    members["cls"] = str(sample % 3)
                for ext, text in members.items():
                    data = text.encode()
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        paths.append(path)
    return paths


def id_tars(
    shard: Shard,
    urls: Any,
    batch_size: int = 4,
    shuffle_window: int | None = None,
    storage_options: dict[str, Any] | None = None,
    ahead: int = 2,
    retries: int = 4,
) -> Any:
    return sharded_tars(
        shard,
        urls,
        batch_size=batch_size,
        ext=("cls", "id"),
        shuffle_window=shuffle_window,
        storage_options=storage_options,
        ahead=ahead,
        retries=retries,
    )


def image_tars(shard: Shard, urls: Any, batch_size: int = 4) -> Any:
    return sharded_tars(shard, urls, batch_size=batch_size, ext=("jpg", "cls"))


def cls_id_step(cls: Any, ids: Any) -> dict[str, Any]:
    return {"cls": ndd.cast(cls, dtype=ndd.int64), "id": ndd.cast(ids, dtype=ndd.int64)}


def decode_step(jpegs: Any, cls: Any) -> dict[str, Any]:
    images = ndd.decoders.image(jpegs, device="cpu")
    return {"image": ndd.resize(images, size=[8, 8]), "label": ndd.cast(cls, dtype=ndd.int64)}
