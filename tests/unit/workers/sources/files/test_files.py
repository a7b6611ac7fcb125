"""Plain files as samples (``workers.sources.files._files``): an ImageFolder listed, a file read
whole, a list's fingerprint, a file table picked from what the user gives."""

from __future__ import annotations

import errno
from pathlib import Path

import numpy as np
import pytest

from workers.sources.files import FileLoader, ListedFiles, list_files, open_files, read_file
from workers.sources.storage import CACHE_DIR_ENV


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    root = tmp_path / "images"
    for label, name in [("dog", "b.jpg"), ("cat", "z.png"), ("dog", "a.jpg"), ("cat", "y.jpg")]:
        (root / label).mkdir(parents=True, exist_ok=True)
        (root / label / name).write_bytes(f"{label}/{name}".encode())
    (root / "cat" / "notes.txt").write_text("not an image")
    return root


def test_an_image_folder_lists_its_classes_and_files_sorted(folder: Path) -> None:
    files, labels = list_files(folder)
    assert [str(Path(f).relative_to(folder)) for f in files] == [
        "cat/y.jpg",
        "cat/z.png",
        "dog/a.jpg",
        "dog/b.jpg",
    ]
    assert labels == [0, 0, 1, 1]


def test_a_file_is_read_whole_and_a_folder_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "x.bin"
    path.write_bytes(bytes(range(256)) * 1000)
    data = read_file(str(path))
    assert data.dtype == np.uint8 and data.tobytes() == path.read_bytes()
    with pytest.raises(IsADirectoryError) as raised:
        read_file(str(tmp_path))
    assert raised.value.errno == errno.EISDIR and raised.value.filename == str(tmp_path)


def test_a_lists_fingerprint_follows_its_paths_and_labels() -> None:
    a = ListedFiles(["x.jpg", "y.jpg"], [0, 1])
    assert a.fingerprint == ListedFiles(["x.jpg", "y.jpg"], [0, 1]).fingerprint
    assert a.fingerprint != ListedFiles(["x.jpg", "y.jpg"], [1, 0]).fingerprint
    assert a.fingerprint != ListedFiles(["y.jpg", "x.jpg"], [0, 1]).fingerprint
    assert a.fingerprint.startswith("files:") and a.parts == "" and len(a) == 2
    assert a.path(1) == "y.jpg" and a.label(1).tolist() == [1]


def test_a_loader_gives_a_files_bytes_and_label(folder: Path) -> None:
    files, labels = list_files(folder)
    load = FileLoader(ListedFiles(files, labels))
    data, label = load(3)
    assert data.tobytes() == b"dog/b.jpg" and label.tolist() == [1]
    assert load.describe(3) == files[3]


def test_a_folder_or_a_list_is_opened_and_labels_go_with_a_list_only(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    indexed = open_files(str(folder), None)
    assert len(indexed) == 4 and indexed.label(2).tolist() == [1]
    listed = open_files(["a.jpg", "b.jpg"], [3, 4])
    assert len(listed) == 2 and listed.label(1).tolist() == [4]
    with pytest.raises(ValueError, match="labels= is for a list of files"):
        open_files(str(folder), [0, 1, 2, 3])
