"""An ImageFolder's index: listed once, read after, rebuilt when the folder changes or the file is
not a whole index, never written next to the data."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from workers.sources.files import _folder_index
from workers.sources.files._files import FileLoader, ListedFiles, list_files
from workers.sources.files._folder_index import FolderIndex, open_folder
from workers.sources.storage import CACHE_DIR_ENV

#: Folder and file names, with what an ImageFolder keeps of them.
CLASSES = {
    "b": ["2.jpg", "1.JPEG", ".hidden.png", "notes.txt", ".jpg", "x y.webp"],
    "a": ["z.tiff", "a.bmp"],
    "empty": ["readme.md"],
    ".cache": ["ignored.jpg"],
}


def age(root: Path, seconds: float = 60) -> None:
    """Date the folder and its class folders ``seconds`` back (an index of a folder changed in
    the last moments is not trusted, and a change must show as another mtime)."""
    when = time.time() - seconds
    for folder in [root, *(p for p in root.iterdir() if p.is_dir())]:
        os.utime(folder, (when, when))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    for folder, names in CLASSES.items():
        (root / folder).mkdir(parents=True)
        for name in names:
            (root / folder / name).touch()
    (root / "a" / "nested.jpg").mkdir()  # listed (as before): reading it fails by its name
    (root / "b" / os.fsdecode(b"caf\xe9.jpg")).touch()  # not UTF-8
    (root / "top.jpg").touch()
    age(root)
    return root


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache" / "file-index"


@pytest.fixture
def scans(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The folders listed from now on, one entry per listing."""
    listed: list[str] = []
    scan = _folder_index.scan_folder

    def counting(root: str) -> Any:
        listed.append(root)
        return scan(root)

    monkeypatch.setattr(_folder_index, "scan_folder", counting)
    return listed


def contents(index: FolderIndex) -> tuple[list[str], list[int]]:
    return (
        [index.path(i) for i in range(len(index))],
        [int(index.label(i)[0]) for i in range(len(index))],
    )


def index_files(cache: Path) -> list[Path]:
    return sorted(cache.glob("*.index"))


def test_the_index_lists_what_list_files_lists(root: Path, cache: Path) -> None:
    files, labels = list_files(root)
    assert [os.path.relpath(f, root) for f in files] == [
        "a/a.bmp",
        "a/nested.jpg",
        "a/z.tiff",
        "b/.hidden.png",
        "b/1.JPEG",
        "b/2.jpg",
        os.fsdecode(b"b/caf\xe9.jpg"),
        "b/x y.webp",
    ]
    assert labels == [0, 0, 0, 1, 1, 1, 1, 1]  # "empty" has no image: label 2 has no file
    built = open_folder(str(root))
    assert contents(built) == (files, labels)
    assert contents(open_folder(str(root))) == (files, labels)  # read from the file
    assert len(index_files(cache)) == 1
    with pytest.raises(IndexError):
        built.path(len(built))


def test_a_folder_is_listed_once_then_read(root: Path, cache: Path, scans: list[str]) -> None:
    first = open_folder(str(root))
    for _ in range(3):
        assert contents(open_folder(str(root))) == contents(first)
    assert scans == [str(root)]


MUTATIONS: dict[str, Callable[[Path], None]] = {
    "file added": lambda root: (root / "a" / "new.jpg").touch(),
    "file removed": lambda root: (root / "b" / "2.jpg").unlink(),
    "file renamed": lambda root: (root / "b" / "2.jpg").rename(root / "b" / "0.jpg"),
    "class added": lambda root: (root / "c").mkdir() or (root / "c" / "c.jpg").touch(),
    "class renamed": lambda root: (root / "a").rename(root / "d"),
    "class replaced": lambda root: (
        (root / "a").rename(root / "old") or (root / "b").rename(root / "a")
    ),
}


@pytest.mark.parametrize("change", MUTATIONS)
def test_a_changed_folder_is_listed_again(
    root: Path, cache: Path, scans: list[str], change: str
) -> None:
    open_folder(str(root))
    MUTATIONS[change](root)
    age(root, 30)  # another mtime than the index recorded, and not a racy one
    assert contents(open_folder(str(root))) == list_files(root)
    assert contents(open_folder(str(root))) == list_files(root)
    assert len(scans) == 2  # the change was seen once, and the new index read after


def test_a_folder_changed_moments_before_its_listing_is_not_indexed(
    root: Path, cache: Path, scans: list[str]
) -> None:
    (root / "a" / "new.jpg").touch()  # its folder's mtime is now: a change could hide in it
    assert contents(open_folder(str(root))) == list_files(root)
    assert contents(open_folder(str(root))) == list_files(root)
    assert len(scans) == 2 and index_files(cache) == []


def test_concurrent_builders_list_once(
    root: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    listed: list[str] = []
    scan = _folder_index.scan_folder

    def slow(path: str) -> Any:
        listed.append(path)
        time.sleep(0.3)  # every other opener arrives while this one lists
        return scan(path)

    monkeypatch.setattr(_folder_index, "scan_folder", slow)
    start = threading.Barrier(8)
    results: list[Any] = [None] * 8

    def build(k: int) -> None:
        start.wait()
        results[k] = contents(open_folder(str(root)))

    threads = [threading.Thread(target=build, args=(k,)) for k in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(listed) == 1
    assert results == [list_files(root)] * 8
    assert [p.name for p in cache.iterdir() if p.suffix == ".tmp"] == []


def _truncate(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _header(data: bytes) -> bytes:
    return data[:16] + b"{" * 8 + data[24:]


CORRUPTIONS: dict[str, Callable[[bytes], bytes]] = {
    "empty": lambda data: b"",
    "truncated": _truncate,
    "one byte short": lambda data: data[:-1],
    "one byte long": lambda data: data + b"\0",
    "not an index": lambda data: b"garbage" * 100,
    "magic": lambda data: b"X" + data[1:],
    "header length": lambda data: data[:8] + (2**40).to_bytes(8, "little") + data[16:],
    "header": _header,
}


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_a_corrupt_or_partial_index_is_ignored_and_rebuilt(
    root: Path, cache: Path, scans: list[str], corruption: str, caplog: pytest.LogCaptureFixture
) -> None:
    expected = contents(open_folder(str(root)))
    (path,) = index_files(cache)
    path.write_bytes(CORRUPTIONS[corruption](path.read_bytes()))
    with caplog.at_level(logging.WARNING, logger="workers"):
        assert contents(open_folder(str(root))) == expected
    assert "ignored the folder index" in caplog.text
    assert contents(open_folder(str(root))) == expected
    assert len(scans) == 2  # listed again once, then the rebuilt index was read


def test_an_inconsistent_index_is_ignored(root: Path, cache: Path, scans: list[str]) -> None:
    open_folder(str(root))
    (path,) = index_files(cache)
    data = bytearray(path.read_bytes())
    names = sum(len(os.fsencode(os.path.basename(f))) for f in list_files(root)[0])
    offsets_end = len(data) - names  # the names are the file's end, after the offsets
    data[offsets_end - 8 : offsets_end] = (names + 1).to_bytes(8, "little")  # the last offset
    path.write_bytes(bytes(data))
    assert contents(open_folder(str(root))) == list_files(root)
    assert len(scans) == 2


def test_a_read_only_data_folder_is_indexed_in_the_cache(
    root: Path, cache: Path, scans: list[str]
) -> None:
    def snapshot() -> list[tuple[str, list[str], list[str]]]:
        return sorted((d, sorted(ds), sorted(fs)) for d, ds, fs in os.walk(root))

    before = snapshot()
    for folder in [root, *(p for p in root.iterdir() if p.is_dir())]:
        folder.chmod(0o555)
    try:
        open_folder(str(root))
        assert contents(open_folder(str(root))) == list_files(root)
    finally:
        for folder in [root, *(p for p in root.iterdir() if p.is_dir())]:
            folder.chmod(0o755)
    assert snapshot() == before  # nothing written next to the data
    assert len(index_files(cache)) == 1 and len(scans) == 1


def test_an_unwritable_cache_lists_the_folder_and_warns_once(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "a-file").touch()
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "a-file" / "cache"))
    monkeypatch.setattr(_folder_index, "_unwritable", set())
    with caplog.at_level(logging.WARNING, logger="workers"):
        for _ in range(2):
            assert contents(open_folder(str(root))) == list_files(root)
    warnings = [r for r in caplog.records if "cannot keep the index" in r.getMessage()]
    assert len(warnings) == 1 and CACHE_DIR_ENV in warnings[0].getMessage()


def test_a_root_that_is_no_image_folder_raises(root: Path, tmp_path: Path, cache: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_folder(str(tmp_path / "missing"))
    with pytest.raises(NotADirectoryError, match="is a file"):
        open_folder(str(root / "top.jpg"))
    with pytest.raises(ValueError, match="no images found"):
        open_folder(str(root / "empty"))  # (its only folder has none)


def test_a_folder_and_its_list_load_the_same(root: Path, cache: Path) -> None:
    (root / "b" / "2.jpg").write_bytes(b"\xff\xd8 bytes")
    files, labels = list_files(root)
    # the listing of the root fixture (see test_the_index_lists_what_list_files_lists)
    assert len(files) == 8 and labels == [0, 0, 0, 1, 1, 1, 1, 1]
    from_folder = FileLoader(open_folder(str(root)))
    from_list = FileLoader(ListedFiles(files, labels))
    loaded: dict[str, bytes] = {}
    for index, path in enumerate(files):
        assert from_folder.describe(index) == from_list.describe(index) == path
        if not os.path.isdir(path):
            (data, label), (expected, expected_label) = from_folder(index), from_list(index)
            assert data.tobytes() == expected.tobytes()
            assert label.tolist() == expected_label.tolist() == [labels[index]]
            loaded[os.path.relpath(path, root)] = data.tobytes()
    # every file but the folder a/nested.jpg was loaded, with its own bytes
    assert len(loaded) == 7 and "a/nested.jpg" not in loaded
    assert loaded["b/2.jpg"] == b"\xff\xd8 bytes"
    assert loaded["a/a.bmp"] == b""
