"""The node's cache directory (``workers.sources.storage._cache``): where it is, one folder per
kind of index."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.sources.storage import CACHE_DIR_ENV, cache_dir


def test_the_cache_directory_follows_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "mine"))
    assert cache_dir("file-index") == tmp_path / "mine" / "file-index"
    monkeypatch.delenv(CACHE_DIR_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir("file-index") == tmp_path / "xdg" / "dali-capture-loader" / "file-index"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir("tar-index") == tmp_path / "home" / ".cache" / "dali-capture-loader" / (
        "tar-index"
    )


def test_every_kind_of_index_has_its_folder_in_one_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    files, tars = cache_dir("file-index"), cache_dir("tar-index")
    assert files != tars and files.parent == tars.parent == tmp_path
    assert not files.exists()  # (named, not made)


@pytest.mark.parametrize("kind", ["", ".", "..", "a/b"])
def test_a_kind_that_is_not_one_folder_is_refused(kind: str) -> None:
    with pytest.raises(ValueError, match="kind must name one folder"):
        cache_dir(kind)


def test_a_summary_that_cannot_be_written_anywhere_names_the_cache_and_its_setting(
    tmp_path: Path,
) -> None:
    from workers.sources.storage import storage_for
    from workers.sources.storage._summaries import write_document

    blocked = tmp_path / "a-file"
    blocked.write_text("")  # (a cache directory under a file: unwritable, root or not)
    cached = blocked / "parquet-summary" / "x.json"
    with pytest.raises(OSError, match=rf"in this node's cache \({blocked}.*set {CACHE_DIR_ENV}"):
        write_document(storage_for(str(tmp_path)), None, cached, b"{}")
