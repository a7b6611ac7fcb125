"""Footers read once per node: remote ones kept in the node's cache by file and identity."""

from __future__ import annotations

from pathlib import Path

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from workers.sources.parquet._footers import FOOTER_CACHE, read_footer_bytes  # noqa: E402
from workers.sources.parquet._kept import node_footers  # noqa: E402
from workers.sources.storage import cache_dir, storage_for  # noqa: E402
from workers.sources.storage._storage import LocalStorage  # noqa: E402


def write(path: Path, rows: int) -> Path:
    pq.write_table(pa.table({"id": list(range(rows))}), path, row_group_size=10)
    return path


def test_remote_footers_are_read_once_then_kept_by_identity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DALI_LOADER_CACHE_DIR", str(tmp_path / "cache"))
    files = [write(tmp_path / f"{k}.parquet", 20 + k) for k in range(3)]
    urls = [f"memory-like://{path}" for path in files]  # (a URL: the key, never opened)
    local = storage_for(str(tmp_path))
    reads: list[int] = []

    def read(number: int) -> bytes:
        reads.append(number)
        return read_footer_bytes(local, str(files[number]), files[number].stat().st_size)

    remote = LocalStorage()
    remote.local = False  # (read as if remote: the cache is only for remote files)
    identities = [(path.stat().st_size, "v1") for path in files]
    first = node_footers(remote, urls, identities, read)
    assert sorted(reads) == [0, 1, 2]
    assert [footer.num_rows for footer in first] == [20, 21, 22]
    again = node_footers(remote, urls, identities, read)  # (another worker, rank, start)
    assert sorted(reads) == [0, 1, 2]
    assert [footer.num_rows for footer in again] == [20, 21, 22]
    assert len(list(cache_dir(FOOTER_CACHE).glob("*.footer"))) == 3
    assert not [p for p in tmp_path.iterdir() if p.suffix not in (".parquet", "")]
    identities[1] = (identities[1][0], "v2")  # (file 1 rewritten: read again)
    node_footers(remote, urls, identities, read)
    assert sorted(reads) == [0, 1, 1, 2]
    for spoilt in cache_dir(FOOTER_CACHE).glob("*.footer"):  # (a spoilt entry: read again)
        spoilt.write_bytes(b"not a footer")
    assert [f.num_rows for f in node_footers(remote, urls, identities, read)] == [20, 21, 22]


def test_local_footers_are_not_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DALI_LOADER_CACHE_DIR", str(tmp_path / "cache"))
    path = write(tmp_path / "a.parquet", 5)
    local = storage_for(str(tmp_path))
    found = node_footers(
        local,
        [str(path)],
        [(path.stat().st_size, "v")],
        lambda n: read_footer_bytes(local, str(path), path.stat().st_size),
    )
    assert found[0].num_rows == 5
    assert not (tmp_path / "cache").exists()


def test_a_start_that_finds_another_half_way_waits_for_it_and_reads_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process that starts while another is reading the node's footers (some kept already)
    waits for it, whatever it found missing: it took a lock of its own, and read them again
    (3 ranks read 10 footers 19 times)."""
    import threading

    from workers.sources.parquet._footers import _keep, _key, set_lock
    from workers.sources.storage import locked

    monkeypatch.setenv("DALI_LOADER_CACHE_DIR", str(tmp_path / "cache"))
    files = [write(tmp_path / f"{k}.parquet", 20 + k) for k in range(4)]
    urls = [f"memory-like://{path}" for path in files]
    local = storage_for(str(tmp_path))
    identities = [(path.stat().st_size, "v1") for path in files]
    folder = cache_dir(FOOTER_CACHE)
    folder.mkdir(parents=True)
    keys = [_key(url, ident) for url, ident in zip(urls, identities, strict=True)]
    paths = [folder / f"{key}.footer" for key in keys]
    footers = [read_footer_bytes(local, str(p), p.stat().st_size) for p in files]
    reads: list[int] = []

    def read(number: int) -> bytes:
        reads.append(number)
        return footers[number]

    remote = LocalStorage()
    remote.local = False
    found: list[list[int]] = []
    with locked(set_lock(folder, paths)):  # (the first process, half-way: 1 footer kept)
        _keep(paths[0], footers[0])
        later = threading.Thread(
            target=lambda: found.append(
                [f.num_rows for f in node_footers(remote, urls, identities, read)]
            )
        )
        later.start()
        later.join(timeout=1.0)
        assert later.is_alive()  # (it waits for the first)
        for number in range(1, 4):
            _keep(paths[number], footers[number])
    later.join(timeout=10)
    assert found == [[20, 21, 22, 23]] and reads == []
