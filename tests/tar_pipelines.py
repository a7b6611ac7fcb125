"""Pipelines and data of the tar-shard tests (workers import them by module)."""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import fsspec
import nvidia.dali.experimental.dynamic as ndd
import pytest
from fsspec.implementations.local import LocalFileSystem

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


def write_payload_tars(
    directory: Path,
    shards: int,
    per_shard: int,
    payload: int,
    *,
    prefix: str = "train",
    digits: int = 4,
) -> list[Path]:
    """``shards`` tar shards of ``per_shard`` samples each, sample ``i`` being ``<key>.bin``
    (``payload`` bytes), ``<key>.cls`` (``i % 3``) and ``<key>.id`` (``i``): read with
    ``id_tars``, a shard's byte range is nearly all of it."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    filler = bytes(range(256)) * (payload // 256 + 2)  # (room for every offset below 256)
    for number in range(shards):
        path = directory / f"{prefix}-{number:0{digits}d}.tar"
        with tarfile.open(path, "w") as tar:
            for sample in range(number * per_shard, (number + 1) * per_shard):
                key = f"s{sample:07d}"
                for ext, data in (
                    ("bin", filler[sample % 256 : sample % 256 + payload]),
                    ("cls", str(sample % 3).encode()),
                    ("id", str(sample).encode()),
                ):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        paths.append(path)
    return paths


def write_idx(paths: list[Path]) -> None:
    """Write each shard's ``.idx`` beside it (what DALI's ``wds2idx`` writes), touching no
    cache."""
    from workers.sources.tars._index import scan
    from workers.sources.tars._wds_idx import format_idx

    for path in paths:
        with open(path, "rb") as stream:
            text = format_idx(scan(str(path), stream, seekable=True))
        assert text is not None
        path.with_suffix(".idx").write_bytes(text)


def summary_of(
    paths: list[Path],
    identity: Callable[[Path], tuple[int, str]] | None = None,
    samples: dict[str, int] | None = None,
) -> bytes:
    """The summary of the shards at ``paths``, their identities as ``identity`` tells (by
    default: as local files); ``samples``: what it says of some shards' sample counts instead
    of the truth (a summary that lies)."""
    from workers.sources.storage import storage_for
    from workers.sources.tars._index import scan
    from workers.sources.tars._summary import ShardEntry, encode

    entries = {}
    for path in paths:
        with open(path, "rb") as stream:
            index = scan(str(path), stream, seekable=True)
        size, version = (identity or (lambda p: storage_for(str(p)).identity(str(p))))(path)
        count = (samples or {}).get(path.name, index.samples)
        entries[path.name] = ShardEntry(size, version, count, index.keys_hash)
    return encode(entries)


def index_beside(paths: list[Path], samples: dict[str, int] | None = None) -> None:
    """Write each local shard's ``.idx`` beside it and the shards' summary (``samples``: see
    :func:`summary_of`), touching no cache: as the index command leaves them, but no worker of
    this node has seen them."""
    from workers.sources.tars._summary import SUMMARY

    write_idx(paths)
    (paths[0].parent / SUMMARY).write_bytes(summary_of(paths, samples=samples))


def lie_in_idx(path: Path, lie: str) -> None:
    """Rewrite the ``.idx`` at ``path`` so that it lies about its tar, its last line kept true
    (the checks of a start, the tar's size and last header, still pass): ``overlap``: the
    second sample's members point at the first one's bytes; ``size``: the second sample's last
    member is one byte longer than it is."""
    lines = path.read_text().split("\n")
    first, second = lines[1].split(), lines[2].split()
    if lie == "overlap":
        for field in range(1, len(second), 4):
            second[field], second[field + 1] = first[field], first[field + 1]
    elif lie == "size":
        second[-2] = str(int(second[-2]) + 1)
    else:
        raise ValueError(f"no such lie: {lie!r}")
    lines[2] = " ".join(second)
    path.write_text("\n".join(lines))


def with_link_member(path: Path, sample: int, member: int = 0) -> None:
    """Rewrite the tar at ``path`` with member number ``member`` of its sample number
    ``sample`` (in tar order) a symbolic link to the member before it: the samples before that
    one are whole, the tar is not a WebDataset shard from there on."""
    with tarfile.open(path) as tar:
        members = []
        for found in tar.getmembers():
            stream = tar.extractfile(found)
            members.append((found, b"" if stream is None else stream.read()))
    keys = [m.name.partition(".")[0] for m, _ in members]
    linked = keys.index(list(dict.fromkeys(keys))[sample]) + member
    with tarfile.open(path, "w") as tar:
        for number, (info, data) in enumerate(members):
            if number == linked:
                info = tarfile.TarInfo(info.name)
                info.type, info.linkname = tarfile.SYMTYPE, members[number - 1][0].name
                data = b""
            tar.addfile(info, io.BytesIO(data))


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


def png_id_tars(
    shard: Shard, urls: Any, batch_size: int = 4, storage_options: dict[str, Any] | None = None
) -> Any:
    """``id_tars`` with a ``.png`` member per sample (see tests/integration/test_tar_faults.py)."""
    return sharded_tars(
        shard,
        urls,
        batch_size=batch_size,
        ext=("cls", "id", "png"),
        storage_options=storage_options,
    )


def png_cls_id_step(cls: Any, ids: Any, pngs: Any) -> dict[str, Any]:
    images = ndd.decoders.image(pngs, device="cpu")
    return {**cls_id_step(cls, ids), "image": ndd.resize(images, size=[4, 4])}


def image_tars(shard: Shard, urls: Any, batch_size: int = 4) -> Any:
    return sharded_tars(shard, urls, batch_size=batch_size, ext=("jpg", "cls"))


def cls_id_step(cls: Any, ids: Any) -> dict[str, Any]:
    return {"cls": ndd.cast(cls, dtype=ndd.int64), "id": ndd.cast(ids, dtype=ndd.int64)}


def decode_step(jpegs: Any, cls: Any) -> dict[str, Any]:
    images = ndd.decoders.image(jpegs, device="cpu")
    return {"image": ndd.resize(images, size=[8, 8]), "label": ndd.cast(cls, dtype=ndd.int64)}


class Ids:
    """``load(i)``: the id ``base + i`` (int64), and ``describe``."""

    def __init__(self, base: int, dtype: Any = "int64") -> None:
        self.base, self.dtype = base, dtype

    def __call__(self, index: int) -> Any:
        import numpy as np

        return np.array([self.base + index], dtype=self.dtype)

    def describe(self, index: int) -> str:
        return f"id{self.base + index}"


def id_mix(
    shard: Shard,
    sizes: tuple[int, ...] = (60, 12),
    weights: tuple[float, ...] = (0.75, 0.25),
    epoch_size: int | None = 48,
    batch_size: int = 4,
    dtypes: tuple[str, ...] = ("int64", "int64"),
) -> Any:
    """A mix of ``len(sizes)`` id sources; source ``k``'s ids start at ``1000 * k``."""
    from loader import SamplesDataset, sharded_mix

    names = [f"src{k}" for k in range(len(sizes))]
    sources = {
        name: SamplesDataset(size, Ids(1000 * k, dtypes[k]), fingerprint=f"ids{k}")
        for k, (name, size) in enumerate(zip(names, sizes, strict=True))
    }
    return sharded_mix(
        shard,
        sources,
        weights=dict(zip(names, weights, strict=True)),
        batch_size=batch_size,
        epoch_size=epoch_size,
        source_output=True,
    )


def id_source_step(ids: Any, source: Any) -> dict[str, Any]:
    return {"id": ndd.cast(ids, dtype=ndd.int64), "source": ndd.cast(source, dtype=ndd.int64)}


def files_and_tars_mix(shard: Shard, root: str, urls: str, batch_size: int = 4) -> Any:
    from loader import FilesDataset, TarsDataset, sharded_mix

    return sharded_mix(
        shard,
        {"folder": FilesDataset(root), "tars": TarsDataset(urls)},
        weights={"folder": 1, "tars": 1},
        batch_size=batch_size,
        source_output=True,
    )


def decode_source_step(jpegs: Any, cls: Any, source: Any) -> dict[str, Any]:
    images = ndd.decoders.image(jpegs, device="cpu")
    return {
        "image": ndd.resize(images, size=[8, 8]),
        "label": ndd.cast(cls, dtype=ndd.int64),
        "source": ndd.cast(source, dtype=ndd.int64),
    }


class ThrottledFileSystem(LocalFileSystem):  # type: ignore[misc]
    """Local files behind ``throttled://`` URLs, served like a slow store: one object at a time
    per process, each open (a read, a scan, a write) taking ``delay`` seconds; an open of a
    path containing ``hang`` never returns. (fsspec's registry: the workers that import this
    module read such URLs through the loader's ordinary remote storage.)"""

    protocol: ClassVar[Any] = "throttled"
    _serving: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, delay: float = 0.0, hang: str = "", **options: Any) -> None:
        super().__init__(**options)
        self.delay, self.hang = delay, hang

    def _open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        if self.hang and self.hang in path:
            time.sleep(3600)
        with self._serving:
            time.sleep(self.delay)
        return super()._open(path, mode, *args, **kwargs)


fsspec.register_implementation("throttled", ThrottledFileSystem, clobber=True)


def wds2idx(tar: Path, out: Path) -> bytes:
    """DALI's own tool on ``tar`` (installed with DALI as ``wds2idx``)."""
    tool = shutil.which("wds2idx") or str(Path(sys.executable).with_name("wds2idx"))
    if not Path(tool).exists():
        pytest.skip("DALI's wds2idx is not installed")
    subprocess.run([tool, str(tar), str(out)], check=True, capture_output=True)
    return out.read_bytes()


class GatedIds(Ids):
    """:class:`Ids` whose samples from ``gated_from`` on wait until the file ``gate`` exists (at
    most ``patience`` seconds, and none after a wait gave up), and note in ``gate + ".waited"``
    how each wait ended: "opened" (the file came) or "gave up"."""

    def __init__(self, gate: str, gated_from: int, patience: float = 30.0) -> None:
        super().__init__(0)
        self.gate, self.gated_from, self.patience = gate, gated_from, patience
        self.gave_up = False

    def __call__(self, index: int) -> Any:
        import os
        import time

        if index >= self.gated_from:
            until = time.monotonic() + (0 if self.gave_up else self.patience)
            while not os.path.exists(self.gate) and time.monotonic() < until:
                time.sleep(0.01)
            self.gave_up = not os.path.exists(self.gate)
            with open(self.gate + ".waited", "a") as notes:
                notes.write("gave up\n" if self.gave_up else "opened\n")
        return super().__call__(index)


def write_image_tars(directory: Path, ids: Any, per_shard: int) -> list[Path]:
    """Tar shards of ``ids``: sample ``i`` is ``<key>.jpg`` (an 8x8 JPEG), ``<key>.cls``
    (``i % 3``) and ``<key>.id`` (``i``)."""
    from tests.parquet_pipelines import jpeg

    directory.mkdir(parents=True, exist_ok=True)
    ids, paths = list(ids), []
    for number, first in enumerate(range(0, len(ids), per_shard)):
        path = directory / f"train-{number:03d}.tar"
        with tarfile.open(path, "w") as tar:
            for sample in ids[first : first + per_shard]:
                members = {"jpg": jpeg(sample), "cls": str(sample % 3).encode()}
                members["id"] = str(sample).encode()
                for ext, data in members.items():
                    info = tarfile.TarInfo(f"s{sample:05d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        paths.append(path)
    return paths


def parquet_and_tars_mix(shard: Shard, parquet: str, tars: str, batch_size: int = 4) -> Any:
    """Parquet files (image, label int64, id) and tar shards (jpg, cls int32, id) in one mix,
    every sample of both once an epoch."""
    from loader import ParquetDataset, TarsDataset, sharded_mix

    return sharded_mix(
        shard,
        {
            "parquet": ParquetDataset(parquet, columns=("image", "label", "id")),
            "tars": TarsDataset(tars, ext=("jpg", "cls", "id")),
        },
        weights={"parquet": 20, "tars": 12},  # (their sizes: every sample once an epoch)
        batch_size=batch_size,
    )


def decode_label_id_step(jpegs: Any, label: Any, ids: Any) -> dict[str, Any]:
    return {
        "image": ndd.decoders.image(jpegs, device="cpu"),
        "label": ndd.cast(label, dtype=ndd.int64),
        "id": ndd.cast(ids, dtype=ndd.int64),
    }
