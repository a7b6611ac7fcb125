"""The plan from footers: files listed, row groups and their byte ranges, bad files named."""

from __future__ import annotations

from pathlib import Path

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from workers.sources.parquet._plan import (  # noqa: E402
    list_parquet,
    open_plan,
    read_footer,
    read_ranges,
)
from workers.sources.storage._storage import LocalStorage  # noqa: E402


def write(path: Path, rows: int, row_group: int, first: int = 0) -> Path:
    table = pa.table({"id": list(range(first, first + rows)), "x": [1.5] * rows})
    pq.write_table(table, path, row_group_size=row_group)
    return path


def test_directories_and_globs_list_parquet_files_in_name_order(tmp_path: Path) -> None:
    for name in ("b.parquet", "a.parquet", "notes.txt"):
        (tmp_path / name).write_bytes(b"x")
    storage = LocalStorage()
    assert list_parquet(str(tmp_path), storage) == [
        str(tmp_path / n) for n in ("a.parquet", "b.parquet")
    ]
    assert list_parquet(str(tmp_path / "*.parquet"), storage)[0].endswith("a.parquet")
    with pytest.raises(FileNotFoundError, match="no file matches"):
        list_parquet(str(tmp_path / "z*.parquet"), storage)


def test_row_groups_are_numbered_across_files(tmp_path: Path) -> None:
    write(tmp_path / "a.parquet", 25, 10)
    write(tmp_path / "b.parquet", 7, 10, first=25)
    plan = open_plan(str(tmp_path), ("id",))
    assert plan.counts.tolist() == [10, 10, 5, 7] and plan.starts.tolist() == [0, 10, 20, 25]
    assert plan.total == 32 and plan.unit_of(26) == (3, 1)
    assert plan.name(3).endswith("b.parquet, row group 0")
    assert (plan.begins < plan.ends).all()
    assert plan.fingerprint().startswith("parquet:")
    again = open_plan([str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")], ("id",))
    assert again.fingerprint() == plan.fingerprint()
    assert open_plan(str(tmp_path), ("id", "x")).fingerprint() != plan.fingerprint()


def test_chunks_side_by_side_are_one_range_and_a_gap_is_read_through_only_when_small() -> None:
    assert read_ranges([(100, 200), (4, 100)]) == ((4, 200),)
    # a gap of 5 bytes of 1,000 wanted: read through (a request saved, 0.5% more bytes)
    assert read_ranges([(0, 500), (505, 1005)]) == ((0, 1005),)
    # a gap of 600 bytes: read apart
    assert read_ranges([(0, 500), (1100, 1600)]) == ((0, 500), (1100, 1600))
    # the gaps read through add up to at most 5% of the bytes wanted
    spans = [(k * 110, k * 110 + 100) for k in range(10)]  # 1,000 wanted, 9 gaps of 10
    ranges = read_ranges(spans)
    through = sum(e - b for b, e in ranges) - 1000
    assert through <= 50 and len(ranges) > 1


def test_a_file_that_is_not_parquet_or_whose_footer_is_cut_is_named(tmp_path: Path) -> None:
    storage = LocalStorage()
    text = tmp_path / "t.parquet"
    text.write_bytes(b"hello world, not parquet")
    with pytest.raises(ValueError, match=r"t\.parquet is not a Parquet file"):
        read_footer(storage, str(text), text.stat().st_size)
    data = write(tmp_path / "d.parquet", 20, 10).read_bytes()
    cut = tmp_path / "c.parquet"
    cut.write_bytes(data[:-100] + data[-8:])
    with pytest.raises(ValueError, match=r"c\.parquet: its Parquet footer"):
        read_footer(storage, str(cut), cut.stat().st_size)


def test_columns_of_another_type_in_another_file_name_both(tmp_path: Path) -> None:
    write(tmp_path / "a.parquet", 5, 10)
    pq.write_table(pa.table({"id": ["s"] * 5}), tmp_path / "b.parquet")
    with pytest.raises(
        ValueError, match=r"'id' is int64 in \S+a\.parquet but string in \S+b\.parquet"
    ):
        open_plan(str(tmp_path), ("id",))


def test_a_name_as_written_wins_over_a_glob_and_double_stars_go_into_directories(
    tmp_path: Path,
) -> None:
    storage = LocalStorage()
    for name in ("a?.parquet", "ab.parquet", "[v2].parquet", "v.parquet"):
        (tmp_path / name).write_bytes(b"x")
    # (a file named with a glob's characters is that file, not what the glob matches)
    assert list_parquet(str(tmp_path / "a?.parquet"), storage) == [str(tmp_path / "a?.parquet")]
    assert list_parquet(str(tmp_path / "[v2].parquet"), storage) == [str(tmp_path / "[v2].parquet")]
    # (a directory so named, beside a sibling the glob would match, and one with braces)
    for directory in ("d*z", "dxz", "d{1,2}"):
        (tmp_path / directory).mkdir()
        (tmp_path / directory / f"{directory}.parquet").write_bytes(b"x")
    for directory in ("d*z", "d{1,2}"):
        assert list_parquet(str(tmp_path / directory), storage) == [
            str(tmp_path / directory / f"{directory}.parquet")
        ]
    # (a glob of directories gives their files)
    assert list_parquet(str(tmp_path / "dx?"), storage) == [str(tmp_path / "dxz" / "dxz.parquet")]
    deep = tmp_path / "deep"
    for sub in ("", "x", "x/y", "x/y/z"):
        (deep / sub).mkdir(parents=True, exist_ok=True)
        (deep / sub / f"{sub.replace('/', '') or 'top'}.parquet").write_bytes(b"x")
    found = list_parquet(str(deep / "**" / "*.parquet"), storage)
    names = ["top.parquet", "x.parquet", "xy.parquet", "xyz.parquet"]
    assert sorted(Path(p).name for p in found) == names


def test_indexing_part_of_a_directory_warns_that_its_summary_names_only_that_part(
    tmp_path: Path,
) -> None:
    from workers.sources.parquet._index import index_parquet

    write(tmp_path / "a.parquet", 5, 5)
    write(tmp_path / "b.parquet", 5, 5, first=5)
    with pytest.warns(UserWarning, match=r"names 1 of its 2 Parquet files \(not b.parquet\)"):
        index_parquet(str(tmp_path / "a.parquet"))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        index_parquet(str(tmp_path))  # (the whole directory: no warning)
