"""An ImageFolder listed once and kept as an index file that workers map. Runs in the worker.

Listing a folder of a million files costs seconds (far more on a network filesystem), and
``sharded_files`` builds its source in every worker at every start, break, resume and replacement.
So the first worker to need a folder lists it and writes an *index file*; every later build, in
any worker of any rank that shares the cache directory, maps that file instead (``mmap``: the
pages of the files a worker reads, not the whole list, and one copy in the page cache).

Who lists: the worker, not the trainer. The trainer never sees the folder (it is an argument the
user's ``source(shard)`` passes inside the worker), so a worker-side index needs no change to the
user's code and serves replacements exactly as first starts. Under an exclusive lock
(``flock``) on ``<index>.lock`` the first worker lists while the others wait for it (the lock is
released when it finishes or dies; its own trainer's startup timeout bounds a stuck one); the
index appears by ``os.replace`` of a complete file, so nobody ever reads a partial one. That is one
listing per cache directory: per node with the default one, per job when
``DALI_LOADER_CACHE_DIR`` names a directory every node shares.

Where: ``$DALI_LOADER_CACHE_DIR``, else ``$XDG_CACHE_HOME/dali-capture-loader``, else
``~/.cache/dali-capture-loader``, in its ``file-index/``; never next to the data, which may be
read-only. When that directory cannot be written, the worker lists the folder itself and warns
once.

Validity: an index records the folder's *identity* -- the inode and ``st_mtime_ns`` of the root and
of every class folder, which change when an entry is added, removed or renamed in them -- and is
used only while they are unchanged (one ``stat`` per class folder, no listing). The stats are
taken before the listing, and an index listed less than :data:`RACY_NS` after a change it records
is not trusted (a change within the filesystem's timestamp granularity could leave an mtime
equal): such an index is not written, and the folder is listed again until it has been quiet
that long. A file that fails any structural check (magic, header, sizes) is ignored and rebuilt.

Fingerprint: the index also keeps a hash of its sorted relative paths (class folder and file
name, in order) and of the files' sizes, made once with the listing (a ``stat`` per file, once
per folder and cache directory): what a loader's state records of the dataset, to refuse a state
saved over other files -- a folder exported again with the same names but other bytes is another
dataset. Its *parts* (each class folder's name, files and bytes) go into the state too, so that a
refused state names the class folders that differ. A file rewritten in place changes no
folder's identity, so an index does not see it (a folder written by renaming files into place,
as copies and syncs do, is listed again).

The file: :data:`MAGIC`, the header's length (little-endian uint64), the header (JSON: root,
classes, identity, counts, fingerprint, each class's bytes), then, 8-byte aligned,
``class_starts`` (int64, the first file of each class and the count), ``offsets`` (int64, where
each file's name starts in ``names``, and the end) and ``names`` (the file names inside their
class folder, as ``os.fsencode`` bytes).
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import logging
import mmap
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..plan import encode_parts
from ..storage import CACHE_DIR_ENV, cache_dir, locked

logger = logging.getLogger("workers")

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp")

MAGIC = b"DLFOLDR1"
FORMAT = 3  # 2: the header holds the fingerprint; 3: the files' sizes are in it
#: An index listed within this many nanoseconds of a change it records is not trusted.
RACY_NS = 2_000_000_000

_Int64s = np.ndarray[Any, np.dtype[np.int64]]
_PREFIX = 16  # magic and header length

#: Directories whose index could not be written (warned about once per process).
_unwritable: set[str] = set()


class FolderIndex:
    """The files and labels of an ImageFolder, in the order :func:`scan_folder` gives: class
    folders sorted (label = position), files sorted inside each. Held in arrays, mapped from an
    index file or made from a listing; a file's path is built when it is asked for."""

    __slots__ = (
        "_class_bytes",
        "_class_labels",
        "_class_starts",
        "_classes",
        "_firsts",
        "_keep",
        "_names",
        "_offsets",
        "_prefixes",
        "fingerprint",
    )

    def __init__(
        self,
        root: str,
        classes: list[str],
        class_starts: _Int64s,
        offsets: _Int64s,
        names: np.ndarray[Any, np.dtype[np.uint8]],
        fingerprint: str,
        class_bytes: list[int],
        keep: object = None,
    ) -> None:
        #: ``files:<hash>`` of the sorted relative paths and sizes (see the module docstring)
        self.fingerprint = fingerprint
        self._classes, self._class_bytes = classes, class_bytes
        self._prefixes = [os.path.join(root, name, "") for name in classes]
        self._class_starts, self._offsets, self._names = class_starts, offsets, names
        self._keep = keep  # the mapping the arrays view
        self._firsts: list[int] = class_starts[1:-1].tolist()  # each class's first file but 0's
        labels = [np.full(1, label, dtype=np.int32) for label in range(len(classes))]
        for label in labels:
            label.flags.writeable = False
        self._class_labels = labels

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def _class(self, index: int) -> int:
        if not 0 <= index < len(self):
            raise IndexError(f"file {index} is not in [0, {len(self)})")
        return bisect.bisect_right(self._firsts, index)

    def path(self, index: int) -> str:
        prefix = self._prefixes[self._class(index)]
        start, end = self._offsets[index : index + 2].tolist()
        return prefix + os.fsdecode(self._names[start:end].tobytes())

    def label(self, index: int) -> np.ndarray[Any, Any]:
        """The label of file ``index``: a read-only int32 array of one element."""
        return self._class_labels[self._class(index)]

    @property
    def parts(self) -> str:
        """Each class folder's name, bytes and files, for a state (:mod:`sources.plan._parts`)."""
        counts = np.diff(self._class_starts).tolist()
        rows = zip(self._classes, self._class_bytes, counts, strict=True)
        return encode_parts("class folder", [(name, size, count) for name, size, count in rows])


def check_folder(root: str) -> None:
    """``FileNotFoundError``/``NotADirectoryError`` when ``root`` is no directory."""
    if os.path.exists(root) and not os.path.isdir(root):
        raise NotADirectoryError(
            f"{root!r} is a file; pass the root directory of an ImageFolder "
            "(root/<class>/<image>.jpg) or a list of files"
        )
    if not os.path.isdir(root):
        raise FileNotFoundError(f"dataset directory {root!r} does not exist")


def scan_folder(root: str) -> tuple[list[str], list[list[str]]]:
    """List ImageFolder ``root``: its class folders (sorted; hidden ones left out) and each one's
    image files (sorted names). Raises ``ValueError`` when there is no image."""
    check_folder(root)
    classes = _classes(root)
    names = [
        sorted(
            name
            for name in os.listdir(os.path.join(root, folder))
            if os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS
        )
        for folder in classes
    ]
    if not any(names):
        raise ValueError(
            f"no images found under {root!r}; expected an ImageFolder layout "
            "root/<class>/<image>.jpg"
        )
    return classes, names


def _classes(root: str) -> list[str]:
    """The class folders of ``root``, sorted (hidden ones left out)."""
    with os.scandir(root) as entries:
        return sorted(e.name for e in entries if e.is_dir() and not e.name.startswith("."))


def open_folder(root: str) -> FolderIndex:
    """The index of ImageFolder ``root`` (a normalised path: the files' paths start with it):
    mapped from the cache when a valid index is there, else listed (by this process, or by
    another that holds the lock, then mapped) and kept there."""
    check_folder(root)
    real = os.path.realpath(root)
    directory = cache_dir("file-index")
    key = hashlib.sha256(f"{real}\0{os.stat(real).st_ino}".encode(errors="surrogateescape"))
    path = directory / f"{key.hexdigest()[:32]}.index"
    index = _read(path, root, real)
    if index is not None:
        return index
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with locked(path.with_suffix(".lock")):
            index = _read(path, root, real)  # (built while this process waited)
            if index is not None:
                return index
            return _build(path, root, real)
    except OSError as error:
        if str(directory) not in _unwritable:
            _unwritable.add(str(directory))
            logger.warning(
                "cannot keep the index of %s in %s (%s): every worker lists the folder "
                "itself; set %s to a writable directory",
                root,
                directory,
                error,
                CACHE_DIR_ENV,
            )
        return _from_listing(root, *scan_folder(root))


def _identity(real: str, classes: list[str]) -> list[list[int]]:
    """[inode, mtime_ns] of the root, then of each class folder."""
    stats = [os.stat(real)] + [os.stat(os.path.join(real, name)) for name in classes]
    return [[stat.st_ino, stat.st_mtime_ns] for stat in stats]


def _racy(identity: list[list[int]], listed_at: int) -> bool:
    return any(mtime >= listed_at - RACY_NS for _inode, mtime in identity)


def _from_listing(root: str, classes: list[str], names: list[list[str]]) -> FolderIndex:
    counts = [len(files) for files in names]
    class_starts = np.zeros(len(classes) + 1, dtype=np.int64)
    np.cumsum(counts, out=class_starts[1:])
    encoded = [os.fsencode(name) for files in names for name in files]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, encoded), np.int64, len(encoded)), out=offsets[1:])
    blob = np.frombuffer(b"".join(encoded), dtype=np.uint8)
    sizes = _sizes(root, classes, names)
    fingerprint = _fingerprint(classes, class_starts, offsets, blob, sizes)
    running = np.concatenate([np.zeros(1, np.int64), np.cumsum(np.maximum(sizes, 0))])
    class_bytes = running[class_starts[1:]] - running[class_starts[:-1]]
    return FolderIndex(
        root, classes, class_starts, offsets, blob, fingerprint, class_bytes.tolist()
    )


def _sizes(root: str, classes: list[str], names: list[list[str]]) -> _Int64s:
    """Every listed file's size, in order (-1: gone since it was listed): one ``stat`` each,
    relative to its class folder."""
    sizes = np.empty(sum(map(len, names)), dtype=np.int64)
    done = 0
    for folder, inside in zip(classes, names, strict=True):
        fd = os.open(os.path.join(root, folder), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for name in inside:
                try:
                    sizes[done] = os.stat(name, dir_fd=fd).st_size
                except OSError:
                    sizes[done] = -1  # (the folder changed: its index is not kept)
                done += 1
        finally:
            os.close(fd)
    return sizes


def _fingerprint(
    classes: list[str],
    class_starts: _Int64s,
    offsets: _Int64s,
    names: np.ndarray[Any, np.dtype[np.uint8]],
    sizes: _Int64s,
) -> str:
    """``files:`` and a hash of the relative paths, in order -- the class folders, where each
    one's files start, and the files' names (the arrays say exactly that) -- and of the files'
    sizes."""
    digest = hashlib.sha256(b"\0".join(os.fsencode(name) for name in classes))
    for array in (class_starts, offsets):
        digest.update(array.astype("<i8", copy=False).tobytes())
    digest.update(names.tobytes())
    digest.update(sizes.astype("<i8", copy=False).tobytes())
    return f"files:{digest.hexdigest()[:16]}"


def _build(path: Path, root: str, real: str) -> FolderIndex:
    """List the folder, write its index to ``path`` (unless racy) and return it."""
    started = time.monotonic()
    listed_at = time.time_ns()
    found = _classes(real)  # to stat them before listing
    identity = _identity(real, found)
    classes, names = scan_folder(root)
    index = _from_listing(root, classes, names)
    if classes != found or _racy(identity, listed_at):
        logger.info(
            "listed %s: %d files in %.1f s (changed in the last %d s: not indexed)",
            root,
            len(index),
            time.monotonic() - started,
            RACY_NS // 10**9,
        )
        return index
    header = json.dumps(
        {
            "format": FORMAT,
            "root": real,
            "classes": classes,
            "identity": identity,
            "files": len(index),
            "name_bytes": int(index._offsets[-1]),
            "fingerprint": index.fingerprint,
            "class_bytes": index._class_bytes,
        }
    ).encode()
    start = -(-(_PREFIX + len(header)) // 8) * 8
    temporary = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(temporary, "wb") as out:
            out.write(MAGIC + len(header).to_bytes(8, "little") + header)
            out.write(b"\0" * (start - _PREFIX - len(header)))
            for array in (index._class_starts, index._offsets, index._names):
                out.write(array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes())
        os.replace(temporary, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
    logger.info(
        "listed %s: %d files in %.1f s; indexed in %s",
        root,
        len(index),
        time.monotonic() - started,
        path,
    )
    return index


def _read(path: Path, root: str, real: str) -> FolderIndex | None:
    """The index at ``path`` when it is whole and the folder is unchanged since; else None (a
    file that is not a whole index is ignored with a warning)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # none yet (or the cache cannot be read: then it cannot be written either)
        return None
    try:
        size = os.fstat(fd).st_size
        mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ) if size >= _PREFIX else None
    finally:
        os.close(fd)
    try:
        if mapped is None:
            raise ValueError("truncated")
        return _parse(mapped, path, root, real)
    except (ValueError, KeyError, TypeError) as error:  # (json.JSONDecodeError is a ValueError)
        logger.warning("ignored the folder index %s (%s): listing the folder again", path, error)
        return None


def _parse(mapped: mmap.mmap, path: Path, root: str, real: str) -> FolderIndex | None:
    """The index in ``mapped``, None when the folder changed since; ``ValueError`` (or
    ``KeyError``/``TypeError`` from the header) when it is not a whole index."""
    if mapped[:8] != MAGIC:
        raise ValueError("not an index")
    length = int.from_bytes(mapped[8:_PREFIX], "little")
    if _PREFIX + length > len(mapped):
        raise ValueError("truncated")
    header = json.loads(mapped[_PREFIX : _PREFIX + length])
    if header["format"] != FORMAT:
        logger.info(
            "the folder index %s has format %s, not %d: listing again",
            path,
            header["format"],
            FORMAT,
        )
        return None
    if header["root"] != real:
        raise ValueError("another folder")
    classes: list[str] = header["classes"]
    files, name_bytes = int(header["files"]), int(header["name_bytes"])
    start = -(-(_PREFIX + length) // 8) * 8
    ends = np.cumsum([start, 8 * (len(classes) + 1), 8 * (files + 1), name_bytes])
    if ends[-1] != len(mapped):
        raise ValueError("truncated")
    class_starts = np.frombuffer(mapped, "<i8", len(classes) + 1, int(ends[0]))
    offsets = np.frombuffer(mapped, "<i8", files + 1, int(ends[1]))
    names = np.frombuffer(mapped, np.uint8, name_bytes, int(ends[2]))
    if (
        class_starts[0] != 0
        or class_starts[-1] != files
        or np.any(np.diff(class_starts) < 0)
        or offsets[0] != 0
        or offsets[-1] != name_bytes
    ):
        raise ValueError("inconsistent")
    try:
        identity = _identity(real, classes)
    except OSError:
        return None  # a class folder is gone: the folder changed
    if identity != header["identity"]:
        logger.debug("the index %s is stale: %s changed since it was listed", path, root)
        return None
    logger.debug("read the index of %s (%d files) from %s", root, files, path)
    fingerprint, class_bytes = header["fingerprint"], header["class_bytes"]
    if not isinstance(fingerprint, str):
        raise ValueError("no fingerprint")
    if not isinstance(class_bytes, list) or len(class_bytes) != len(classes):
        raise ValueError("no sizes")
    return FolderIndex(
        root, classes, class_starts, offsets, names, fingerprint, class_bytes, keep=mapped
    )
