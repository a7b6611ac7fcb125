"""DALI's ``.idx`` files: written byte for byte as ``wds2idx`` does, read by DALI, bad ones
refused."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from tests import tar_pipelines as T
from workers.sources.tars._shards import open_shards


def _webdataset_tars(directory: Path, shards: int, per_shard: int) -> list[Path]:
    """Shards written by the ``webdataset`` package's own ``TarWriter`` (pax headers, mtimes)."""
    wds = pytest.importorskip("webdataset")
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for number in range(shards):
        path = directory / f"wds-{number:03d}.tar"
        with wds.TarWriter(str(path)) as writer:
            for sample in range(number * per_shard, (number + 1) * per_shard):
                writer.write(
                    {
                        "__key__": f"dir{sample % 2}/s{sample:05d}",
                        "cls": str(sample % 3),
                        "id": str(sample),
                        "seg.png": b"\x89PNG" * (sample + 1),
                    }
                )
        paths.append(path)
    return paths


@pytest.mark.parametrize("writer", ["tarfile", "webdataset"])
def test_an_index_written_by_the_loader_is_byte_for_byte_what_wds2idx_writes(
    tmp_path: Path, writer: str
) -> None:
    from workers.sources.tars._index import scan
    from workers.sources.tars._wds_idx import format_idx, parse_idx

    if writer == "tarfile":
        paths = T.write_id_tars(tmp_path, 14, 7)
    else:
        paths = _webdataset_tars(tmp_path, 2, 7)
    for path in paths:
        theirs = T.wds2idx(path, tmp_path / "theirs.idx")
        with open(path, "rb") as stream:
            ours = scan(str(path), stream, seekable=True)
        assert format_idx(ours) == theirs
        read = parse_idx(str(path), "theirs.idx", theirs)
        assert read.keys_hash == ours.keys_hash and read.exts == ours.exts
        for name in ("member_sample", "member_ext", "member_offset", "member_size"):
            assert getattr(read, name).tolist() == getattr(ours, name).tolist()


def test_dali_reads_the_indexes_the_loader_writes(tmp_path: Path) -> None:
    """``fn.readers.webdataset`` with ``index_paths`` = the ``.idx`` files the loader wrote."""
    from nvidia.dali import fn, pipeline_def

    paths = T.write_id_tars(tmp_path, 30, 7)
    shards = open_shards([str(p) for p in paths], None, 0.0, publish=True)  # (scanned, written)
    indexes = [str(p.with_suffix(".idx")) for p in paths]
    assert all(Path(i).exists() for i in indexes)

    @pipeline_def(batch_size=6, num_threads=1, device_id=None)  # type: ignore[misc]
    def read() -> tuple[object, object]:
        cls, ids = fn.readers.webdataset(
            paths=[str(p) for p in paths],
            index_paths=indexes,
            ext=["cls", "id"],
            missing_component_behavior="error",
            name="reader",
        )
        return cls, ids

    pipe = read()
    pipe.build()
    assert pipe.epoch_size("reader") == shards.total == 30
    seen = []
    for _ in range(5):
        cls, ids = pipe.run()
        for k in range(len(ids)):
            seen.append(int(bytes(np.asarray(ids.at(k))).decode()))
            assert int(bytes(np.asarray(cls.at(k))).decode()) == seen[-1] % 3
    assert seen == list(range(30))


def _two_samples_on_one_line(text: str) -> str:
    lines = text.split("\n")
    lines[0] = "v1.2 6"
    lines[1:3] = [lines[1] + " " + lines[2]]
    return "\n".join(lines)


@pytest.mark.parametrize(
    ("spoil", "message"),
    [
        (lambda t: t.replace("v1.2", "v1.1", 1), r"is a v1\.1 index"),
        (lambda t: t.replace("v1.2 7", "v1.2 8", 1), "announces 8 samples but holds 7"),
        (lambda t: t.replace(" 1536 ", " 1537 ", 1), "line 2: offset 1537 is not a multiple"),
        (lambda t: t.replace("cls 1536", "jpg 1536", 1), "listed with extension 'jpg'"),
        (_two_samples_on_one_line, "line 2: member .* belongs to the sample of another"),
    ],
    ids=["v1.1", "count", "offset", "extension", "two-samples-on-a-line"],
)
def test_a_bad_idx_is_refused_naming_its_line_and_the_shard_is_scanned(
    tmp_path: Path, spoil: object, message: str, caplog: pytest.LogCaptureFixture
) -> None:
    from workers.sources.tars._wds_idx import parse_idx

    (path,) = T.write_id_tars(tmp_path, 7, 7)
    text = T.wds2idx(path, tmp_path / "train-000.idx").decode()
    assert "cls 1536 1 group0/s00000.cls" in text.split("\n")[1]
    bad = spoil(text)  # type: ignore[operator]
    with pytest.raises(ValueError, match=message):
        parse_idx(str(path), "x.idx", bad.encode())
    (tmp_path / "train-000.idx").write_text(bad)
    caplog.set_level(logging.INFO, logger="workers")
    shards = open_shards(str(path), None, 0.0, publish=True)  # (the .idx written again)
    assert shards.counts.tolist() == [7]
    assert [r for r in caplog.records if "ignored" in r.message and "train-000.idx" in r.message]
    assert [r for r in caplog.records if r.message.startswith("indexed ")]
    assert (tmp_path / "train-000.idx").read_bytes() == T.wds2idx(path, tmp_path / "again.idx")
