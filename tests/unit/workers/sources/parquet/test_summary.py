"""The Parquet summary's bytes: the metadata every footer repeats kept once, each footer rebuilt
byte for byte, and the older form still read."""

from __future__ import annotations

import base64
import json
import zlib
from pathlib import Path

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from workers.sources.parquet._footers import parse_footer, read_footer_bytes  # noqa: E402
from workers.sources.parquet._summary import decode, encode, entry_of  # noqa: E402
from workers.sources.storage import storage_for  # noqa: E402


def _entries(tmp_path: Path, files: int) -> dict[str, object]:
    """Files with the same schema and a large ``huggingface`` metadata, as ``datasets`` writes
    them (its class names), each its own rows."""
    names = [f"class-{k:04d}" for k in range(1000)]
    features = {"label": {"names": names, "_type": "ClassLabel"}}
    metadata = {b"huggingface": json.dumps({"info": {"features": features}}).encode()}
    schema = pa.schema([("label", pa.int64()), ("id", pa.int64())], metadata=metadata)
    storage = storage_for(str(tmp_path), None, 1)
    entries = {}
    for number in range(files):
        path = tmp_path / f"train-{number:03d}.parquet"
        table = pa.table({"label": [number, 1], "id": [2 * number, 2 * number + 1]}, schema=schema)
        pq.write_table(table, path, row_group_size=1)
        size = path.stat().st_size
        footer = read_footer_bytes(storage, str(path), size)
        entries[path.name] = entry_of(
            (size, f"mtime:{number}"), footer, parse_footer(str(path), footer)
        )
    return entries


def test_the_metadata_every_footer_repeats_is_kept_once_and_each_footer_rebuilt_exactly(
    tmp_path: Path,
) -> None:
    entries = _entries(tmp_path, 30)
    data = encode(entries)
    each_alone = sum(len(base64.b64encode(zlib.compress(e.footer, 6))) for e in entries.values())  # type: ignore[attr-defined]
    assert json.loads(data)["version"] == 2
    assert len(data) * 5 < each_alone  # (the metadata repeated in every footer: counted once)
    assert decode(data, "s") == entries


def test_a_version_1_summary_is_still_read_and_a_cut_footer_is_named(tmp_path: Path) -> None:
    entries = _entries(tmp_path, 3)
    document = json.loads(encode(entries))
    document["version"] = 1
    del document["shared"]
    for row in document["files"]:
        row[5] = base64.b64encode(zlib.compress(entries[row[0]].footer, 6)).decode()  # type: ignore[attr-defined]
    assert decode(json.dumps(document).encode(), "old") == entries
    current = json.loads(encode(entries))
    current["files"][1][5][0] = base64.b64encode(
        base64.b64decode(current["files"][1][5][0])[:-6]
    ).decode()
    with pytest.raises(ValueError, match=r"cut\.json has a malformed file entry"):
        decode(json.dumps(current).encode(), "cut.json")
    current = json.loads(encode(entries))
    current["version"] = 3
    with pytest.raises(ValueError, match="run python -m loader index again"):
        decode(json.dumps(current).encode(), "new.json")


def test_a_file_with_other_metadata_or_a_value_twice_is_rebuilt_exactly(tmp_path: Path) -> None:
    entries = _entries(tmp_path / "a", 2) if (tmp_path / "a").mkdir() is None else {}
    other = tmp_path / "other.parquet"
    value = "x" * 4000
    table = pa.table({"label": [1]}).replace_schema_metadata({"one": value, "two": value})
    pq.write_table(table, other)
    storage = storage_for(str(other), None, 1)
    size = other.stat().st_size
    footer = read_footer_bytes(storage, str(other), size)
    entries["zz-other.parquet"] = entry_of((size, "v"), footer, parse_footer(str(other), footer))
    assert decode(encode(entries), "s") == entries
    alone = {"other.parquet": entries["zz-other.parquet"]}  # (its value twice, shared once)
    assert decode(encode(alone), "s") == alone
    assert len(encode(alone)) < 3000
