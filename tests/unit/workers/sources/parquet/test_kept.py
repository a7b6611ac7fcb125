"""A plan's footers kept small: bytes without the metadata every file repeats, parsed when a
file's row groups are read, a few at a time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from workers.sources import ParquetDataset  # noqa: E402
from workers.sources.parquet._footers import parse_footer, read_footer_bytes  # noqa: E402
from workers.sources.parquet._kept import PARSED, KeptFooters  # noqa: E402
from workers.sources.parquet._summary import decode, encode, entry_of  # noqa: E402
from workers.sources.storage import storage_for  # noqa: E402
from workers.spec import Shard  # noqa: E402


def _files(directory: Path, count: int) -> list[Path]:
    """Files as ``datasets`` writes them: a 1,000-name ``ClassLabel`` in the footer's metadata
    (twice: the features, and pyarrow's Arrow schema with them)."""
    directory.mkdir(parents=True, exist_ok=True)
    features = {"label": {"names": [f"n{k:08d}" for k in range(1000)], "_type": "ClassLabel"}}
    metadata = {b"huggingface": json.dumps({"info": {"features": features}}).encode()}
    schema = pa.schema([("label", pa.int64()), ("id", pa.int64())], metadata=metadata)
    paths = []
    for number in range(count):
        path = directory / f"train-{number:04d}.parquet"
        rows = {"label": [number % 1000, 1, 2], "id": [3 * number, 3 * number + 1, 3 * number + 2]}
        pq.write_table(pa.table(rows, schema=schema), path, row_group_size=2)
        paths.append(path)
    return paths


def _footer(path: Path) -> bytes:
    return read_footer_bytes(storage_for(str(path)), str(path), path.stat().st_size)


def test_each_footer_comes_back_exactly_and_is_kept_a_tenth_of_its_size(tmp_path: Path) -> None:
    paths = _files(tmp_path, 20)
    footers = [_footer(path) for path in paths]
    kept = KeptFooters([str(p) for p in paths], footers)
    assert [kept.data(k) for k in range(20)] == footers
    assert [kept[k].num_rows for k in range(20)] == [3] * 20
    held = sum(len(packed) for packed, _cuts, _shared in kept._kept if packed)  # type: ignore[misc]
    assert held * 10 < sum(len(f) for f in footers)  # (the metadata held once)
    assert len(kept._parsed) <= PARSED  # (parsed footers: the last few asked for only)


def test_a_spoilt_footer_is_read_again_where_it_can_be_and_named_where_not(
    tmp_path: Path,
) -> None:
    paths = _files(tmp_path, 3)
    footers = [_footer(path) for path in paths]
    reread: list[int] = []

    def again(number: int) -> bytes | None:
        reread.append(number)
        return footers[number] if number != 2 else None

    kept = KeptFooters([str(p) for p in paths], [footers[0], b"spoilt", b"spoilt"], again)
    assert kept[1].num_rows == 3 and reread == [1]
    assert kept[1].num_rows == 3 and reread == [1]  # (put back: not read again)
    with pytest.raises(ValueError, match=r"train-0002\.parquet: its Parquet footer cannot be read"):
        kept[2]


def test_a_summarys_entries_are_kept_as_the_summary_keeps_them(tmp_path: Path) -> None:
    paths = _files(tmp_path, 4)
    entries = {}
    for path in paths:
        data = _footer(path)
        size = path.stat().st_size
        entries[path.name] = entry_of((size, "v"), data, parse_footer(str(path), data))
    decoded = decode(encode(entries), "s")
    kept = KeptFooters([str(p) for p in paths], [decoded[p.name] for p in paths])
    assert all(kept._kept[k][0] is decoded[p.name].kept for k, p in enumerate(paths))  # type: ignore[index]
    assert [kept.data(k) for k in range(4)] == [entries[p.name].footer for p in paths]


def test_a_plan_over_many_files_keeps_only_a_few_footers_parsed(tmp_path: Path) -> None:
    count = PARSED * 3
    _files(tmp_path / "data", count)
    shard = Shard.make(rank=0, world_size=1, worker=0, num_workers=1, seed=0)
    opened = ParquetDataset(str(tmp_path / "data"), columns=("label", "id")).open(shard, 0)
    assert opened.total == 3 * count
    plan = opened.load.plan  # type: ignore[attr-defined]
    assert isinstance(plan.footers, KeptFooters)
    assert len(plan.footers._parsed) <= PARSED
    assert plan.file_rows == [3] * count
