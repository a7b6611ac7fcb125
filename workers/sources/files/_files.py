"""``sharded_files``: the samples of ``sharded_source`` read from image files. Runs in the worker.

A source over an ImageFolder or an explicit list of files: each sample is a file's encoded bytes
and its label, for DALI's decoders. An ImageFolder is not listed here: its index
(:mod:`._folder_index`) is listed once per cache directory and mapped by every worker, so a
worker holds its shard's paths only as it reads them, whatever the folder's size.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ._folder_index import open_folder, scan_folder
from ._image_size import MAX_IMAGE_PIXELS, ImageTooLargeError, over_limit


def list_files(root: str | os.PathLike[str]) -> tuple[list[str], list[int]]:
    """Files and labels of an ImageFolder ``root/<class>/<file>``: class folders sorted (label =
    position), files sorted inside each; the same list on every rank and worker. Lists the
    folder (``sharded_files`` reads its index instead)."""
    base = str(Path(root))
    classes, names = scan_folder(base)
    files = [
        prefix + name
        for prefix, inside in zip(
            (os.path.join(base, folder, "") for folder in classes), names, strict=True
        )
        for name in inside
    ]
    labels = [label for label, inside in enumerate(names) for _ in inside]
    return files, labels


class FileTable(Protocol):
    """The files of a ``sharded_files`` source: a path and a label per sample id, and what
    they are as a whole (``files:<hash>`` of the list; a state records it)."""

    fingerprint: str

    @property
    def parts(self) -> str:
        """What the files are, part by part, for a state (:mod:`.plan._parts`; empty: none)."""

    def __len__(self) -> int: ...

    def path(self, index: int) -> str: ...

    def label(self, index: int) -> np.ndarray[Any, Any]: ...


class ListedFiles:
    """An explicit list of files and their labels."""

    def __init__(self, files: Sequence[str], labels: Sequence[int]) -> None:
        self._files = list(files)
        self._labels = np.asarray(labels, dtype=np.int32).reshape(-1, 1)
        # the paths as given, in order, and their labels (the list is in memory already)
        digest = hashlib.sha256("\0".join(self._files).encode(errors="surrogateescape"))
        digest.update(self._labels.astype("<i4", copy=False).tobytes())
        self.fingerprint = f"files:{digest.hexdigest()[:16]}"

    @property
    def parts(self) -> str:
        return ""  # (a list's files are not grouped; their sizes are not read: see sharded_files)

    def __len__(self) -> int:
        return len(self._files)

    def path(self, index: int) -> str:
        return self._files[index]

    def label(self, index: int) -> np.ndarray[Any, Any]:
        label: np.ndarray[Any, Any] = self._labels[index]
        return label


class FileLoader:
    """``load(index)`` for :func:`sharded_files`: the file's bytes and its label. An image whose
    header says it decodes to more than ``max_pixels`` pixels raises
    :class:`~sources.files._image_size.ImageTooLargeError` instead (None: no limit)."""

    def __init__(self, files: FileTable, max_pixels: int | None = MAX_IMAGE_PIXELS) -> None:
        self.files = files
        self.max_pixels = max_pixels

    def describe(self, index: int) -> str:
        return self.files.path(index)

    def __call__(self, index: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        path = self.files.path(index)
        data = read_file(path)
        size = over_limit(data, self.max_pixels)
        if size is not None:
            assert self.max_pixels is not None
            raise ImageTooLargeError.of(
                path, size, self.max_pixels, "sharded_files or FilesDataset"
            )
        return data, self.files.label(index)


def read_file(path: str) -> np.ndarray[Any, Any]:
    """A file's bytes as a uint8 array: one open, fstat, readv and close (``np.fromfile`` costs
    about three times as much CPU per small file, which a batch of 64 images feels)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = np.empty(os.fstat(fd).st_size, dtype=np.uint8)
        done = os.readv(fd, [data.data])
        while done < data.size:  # a short read: go on until the file's end
            more = os.readv(fd, [data[done:].data])
            if more == 0:  # the file shrank since fstat
                return data[:done]
            done += more
        return data
    except OSError as error:
        if error.filename is None:  # e.g. EISDIR from readv: name the file
            error.filename = path
        raise
    finally:
        os.close(fd)


def open_files(
    root_or_files: str | os.PathLike[str] | Sequence[str], labels: Sequence[int] | None
) -> FileTable:
    """The files of an ImageFolder (its index) or of a list with its labels."""
    if isinstance(root_or_files, (str, os.PathLike)):
        if labels is not None:
            raise ValueError(
                "labels= is for a list of files; an ImageFolder's come from its folders"
            )
        return open_folder(str(Path(root_or_files)))
    paths = [os.fspath(f) for f in root_or_files]
    if not paths:
        raise ValueError("the list of files is empty")
    found = [0] * len(paths) if labels is None else [int(label) for label in labels]
    if len(found) != len(paths):
        raise ValueError(f"{len(paths)} files but {len(found)} labels: give one per file")
    return ListedFiles(paths, found)
