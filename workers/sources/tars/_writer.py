"""``write_tars``: an ImageFolder written as WebDataset tar shards, each with its ``.idx``, and the
directory's summary. Runs wherever it is called (``python -m loader.tars write``)."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import numpy as np

from ..files import list_files, read_file
from ..storage import Storage, storage_for
from ._index import IndexBuilder
from ._shards import shard_entries
from ._summary import read_summary, updated, write_summary
from ._wds_idx import format_idx, idx_url

_BLOCK = 512


def write_tars(
    root: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    samples_per_shard: int,
    shuffle: bool = True,
    seed: int = 0,
    prefix: str = "train",
) -> list[Path]:
    """Write ImageFolder ``root`` as WebDataset shards ``<out>/<prefix>-000000.tar``...: each
    sample ``<key>.<image ext>`` (the file's bytes) and ``<key>.cls`` (its label), keys numbered
    in the written order. ``shuffle``: samples in a seeded random order (so each shard holds a
    mix of classes, which shuffling by groups of shards needs), else in the folder's order.
    The same folder and seed always give the same bytes. Each shard gets its index beside it
    (``<prefix>-000000.idx``, DALI's ``wds2idx`` format) and ``out`` the shards' summary
    (``loader-summary.json``), so readers never scan them."""
    if isinstance(samples_per_shard, bool) or not isinstance(samples_per_shard, int):
        raise ValueError(f"samples_per_shard must be an integer, got {samples_per_shard!r}")
    if samples_per_shard < 1:
        raise ValueError(f"samples_per_shard must be >= 1, got {samples_per_shard}")
    files, labels = list_files(root)
    order = np.arange(len(files))
    if shuffle:
        order = np.random.default_rng(seed).permutation(len(files))
    target = Path(out)
    target.mkdir(parents=True, exist_ok=True)
    storage = storage_for(str(target))
    written: list[Path] = []
    counts, hashes = [], []
    for number, first in enumerate(range(0, len(files), samples_per_shard)):
        path = target / f"{prefix}-{number:06d}.tar"
        temporary = path.with_name(path.name + ".tmp")
        builder = IndexBuilder(str(path))
        with tarfile.open(temporary, "w", format=tarfile.USTAR_FORMAT) as tar:
            for key_number in order[first : first + samples_per_shard].tolist():
                source = files[key_number]
                ext = os.path.splitext(source)[1].lower().lstrip(".")
                ext = "jpg" if ext == "jpeg" else ext
                key = f"{key_number:09d}"
                for name, data in (
                    (f"{key}.{ext}", read_file(source).tobytes()),
                    (f"{key}.cls", str(labels[key_number]).encode()),
                ):
                    offset = _add(tar, name, data)
                    builder.add(name, offset, len(data), str(path), f"at byte {offset}")
        index = builder.build()
        text = format_idx(index)
        assert text is not None  # (keys are numbers, extensions have no white space)
        os.replace(temporary, path)
        storage.write(idx_url(str(path)), text)
        written.append(path)
        counts.append(index.samples)
        hashes.append(index.keys_hash)
    if written:
        _summarize(storage, written, counts, hashes)
    return written


def _summarize(storage: Storage, paths: list[Path], counts: list[int], hashes: list[str]) -> None:
    urls = [str(path) for path in paths]
    directory = storage.dirname(urls[0])
    listing = storage.listing(directory)
    identities = storage.identities(urls)
    entries = shard_entries(storage, urls, np.asarray(counts), hashes, identities)[directory]
    old = read_summary(storage, directory, listing)
    merged = updated({} if old is None else old[0], entries, listing)
    write_summary(storage, directory, merged, beside=True)


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> int:
    """Add member ``name``; returns where its data starts in the tar."""
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o444, 0
    tar.addfile(info, io.BytesIO(data))
    return tar.offset - -(-len(data) // _BLOCK) * _BLOCK
