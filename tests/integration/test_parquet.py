"""sharded_parquet over Parquet written by Hugging Face ``datasets``: every guarantee of
sharded_source, through workers, on both layouts users meet (100-row row groups; one large row
group), with fewer files than workers, over simulated ranks."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("datasets")

from loader import Loader, ParquetDataset, sharded_parquet, texts
from tests import parquet_pipelines as P

pytestmark = pytest.mark.timeout(240)

#: 100-row row groups over files of uneven sizes (row groups 100, 100, 50 | 100, 30 | 40)
SMALL = (250, 130, 40)
#: one file, one large row group
LARGE = (300,)


def real(batch: Any, name: str) -> list[int]:
    values = [int(v) for v in np.asarray(batch[name]).ravel()]
    return values[: len(values) - batch.info.padded]


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("small")
    P.write_parquet(root, SMALL, 100)
    return root


@pytest.fixture(scope="module")
def large(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("large")
    P.write_parquet(root, LARGE, 10_000)
    return root


def loader_over(urls: Any, workers: int = 2, **kw: Any) -> Loader:
    options = {k: kw.pop(k) for k in ("shuffle_window", "storage_options", "columns") if k in kw}
    source = functools.partial(P.id_parquet, urls=urls, **options)
    return Loader(source, P.label_id_step, batch_size=4, num_workers=workers, copy=True, **kw)


def ids_of_ranks(urls: Any, workers: int, ranks: int, epochs: int = 2) -> list[list[int]]:
    """Every rank's ids of each epoch, their labels checked against the ids."""
    loaders = [
        loader_over(urls, workers, rank=r, world_size=ranks)
        if ranks > 1
        else loader_over(urls, workers)
        for r in range(ranks)
    ]
    try:
        assert len({len(loader) for loader in loaders}) == 1  # equal steps on every rank
        seen: list[list[int]] = [[] for _ in range(epochs)]
        for loader in loaders:
            for epoch in range(epochs):
                for batch in loader:
                    ids, labels = real(batch, "id"), real(batch, "label")
                    assert labels == [i % 3 for i in ids]
                    seen[epoch] += ids
    finally:
        for loader in loaders:
            loader.close()
    return seen


@pytest.mark.parametrize(
    ("layout", "workers", "ranks"), [("small", 2, 1), ("small", 1, 2), ("large", 2, 2)]
)
def test_every_row_once_per_epoch(
    layout: str, workers: int, ranks: int, request: pytest.FixtureRequest
) -> None:
    root: Path = request.getfixturevalue(layout)
    total = sum(SMALL if layout == "small" else LARGE)
    epochs = ids_of_ranks(str(root), workers, ranks)
    for ids in epochs:
        assert sorted(ids) == list(range(total))
    assert epochs[0] != epochs[1]  # a new order every epoch


def test_images_are_the_encoded_bytes_of_the_image_column(small: Path) -> None:
    source = functools.partial(P.image_parquet, urls=str(small / "train-00002.parquet"))
    with Loader(source, P.decode_step, batch_size=4, num_workers=1, copy=True) as loader:
        batches = list(loader)
    seen = []
    for batch in batches:
        images = [np.asarray(image) for image in batch["image"]]
        for image, row in zip(images, real(batch, "id"), strict=False):
            assert image.shape == (8, 8, 3)
            assert abs(int(image[..., 0].mean()) - row % 256) <= 3  # (its id, in red)
            seen.append(row)
    assert sorted(seen) == list(range(380, 420))


@pytest.mark.parametrize("layout", ["small", "large"])
def test_resume_on_the_same_and_another_layout_is_exact(
    layout: str, request: pytest.FixtureRequest
) -> None:
    root: Path = request.getfixturevalue(layout)
    total = sum(SMALL if layout == "small" else LARGE)
    urls = str(root)
    with loader_over(urls) as loader:
        epochs = [[real(b, "id") for b in loader] for _ in range(2)]
    with loader_over(urls) as loader:
        iterator = iter(loader)
        taken = [real(next(iterator), "id") for _ in range(5)]
        state = json.loads(json.dumps(loader.state_dict()))
    assert state["sampling"]["fingerprint"].startswith("parquet:")
    with loader_over(urls) as loader:  # the same layout: the same stream
        loader.load_state_dict(state)
        assert taken + [real(b, "id") for b in loader] == epochs[0]
        assert [real(b, "id") for b in loader] == epochs[1]
    with loader_over(urls, workers=3) as loader:  # another: once each
        loader.load_state_dict(state)
        rest = [i for batch in loader for i in real(batch, "id")]
    assert sorted([i for ids in taken for i in ids] + rest) == list(range(total))


def test_a_state_over_other_files_names_the_file_missing(small: Path, tmp_path: Path) -> None:
    with loader_over(str(small)) as loader:
        next(iter(loader))
        state = loader.state_dict()
    for name in ("train-00000.parquet", "train-00002.parquet"):
        shutil.copy(small / name, tmp_path / name)
    with loader_over(str(tmp_path)) as loader:
        with pytest.raises(ValueError, match=r"files missing here: train-00001\.parquet"):
            loader.load_state_dict(state)


def _not_parquet(root: Path) -> None:
    (root / "train-00001.parquet").write_bytes(b"just some text, not Parquet at all\n" * 4)


def _truncated_footer(root: Path) -> None:
    path = root / "train-00001.parquet"
    data = path.read_bytes()
    path.write_bytes(data[:-200] + data[-8:])  # (the length and magic kept: the footer cut)


def _other_label_type(root: Path) -> None:
    import datasets

    dataset = P.hf_dataset(range(130)).cast_column("label", datasets.Value("string"))
    dataset.to_parquet(str(root / "train-00001.parquet"), batch_size=100)


@pytest.mark.parametrize(
    ("spoil", "message"),
    [
        (_not_parquet, r"train-00001\.parquet is not a Parquet file"),
        (_truncated_footer, r"train-00001\.parquet: its Parquet footer"),
        (
            _other_label_type,
            r"column 'label' is int64 in \S*train-00000\.parquet but string in "
            r"\S*train-00001\.parquet",
        ),
    ],
)
def test_bad_files_fail_before_the_first_batch_naming_them(
    small: Path, tmp_path: Path, spoil: Any, message: str
) -> None:
    root = tmp_path / "data"
    shutil.copytree(small, root)
    spoil(root)
    with pytest.raises(ValueError, match=message):
        loader_over(str(root))


def test_a_missing_file_among_several_is_named(small: Path) -> None:
    typo = str(small / "train-0001.parquet")
    with pytest.raises(FileNotFoundError, match=re.escape(typo) + ": no such file"):
        loader_over([str(small / "train-00000.parquet"), typo])


def test_a_missing_column_names_the_file_and_the_columns_it_has(small: Path) -> None:
    with pytest.raises(
        ValueError, match=r"train-00000\.parquet has no column 'caption'; its columns: image, "
    ):
        loader_over(str(small), columns=("image", "caption"))


def _damage_row_group(path: Path, group: int) -> tuple[int, int]:
    """Overwrite the middle of row group ``group``'s ``id`` chunk with garbage; its range."""
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path).metadata.row_group(group)
    names = [meta.column(k).path_in_schema for k in range(meta.num_columns)]
    chunk = meta.column(names.index("id"))
    start, size = chunk.data_page_offset, chunk.total_compressed_size
    data = bytearray(path.read_bytes())
    data[start : start + size] = b"\xff" * size
    path.write_bytes(bytes(data))
    return start, size


def test_an_unreadable_row_group_is_named_with_its_byte_range(small: Path, tmp_path: Path) -> None:
    root = tmp_path / "data"
    shutil.copytree(small, root)
    _damage_row_group(root / "train-00000.parquet", 1)  # (rows 100-199)
    with loader_over(str(root)) as loader, pytest.raises(Exception) as raised:
        for _batch in loader:
            pass
    assert "train-00000.parquet: row group 1 (bytes " in str(raised.value)


def _cut_last_row_group(path: Path) -> None:
    """Bytes taken out of the last row group's chunks, the footer kept: a file truncated in
    its data (its footer still whole), as a copy cut short and mended by hand would be."""
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path).metadata
    last = meta.row_group(meta.num_row_groups - 1)
    start = last.column(0).data_page_offset
    data = path.read_bytes()
    path.write_bytes(data[: start + 10] + data[start + 12_000 :])


def test_a_truncated_row_group_fails_the_start_or_is_left_out_under_skip(
    small: Path, tmp_path: Path
) -> None:
    root = tmp_path / "data"
    shutil.copytree(small, root)
    _cut_last_row_group(root / "train-00000.parquet")  # (rows 200-249)
    with pytest.raises(ValueError, match=r"train-00000\.parquet: row group 2 \(bytes \d+-\d+\)"):
        loader_over(str(root))
    loaders = [loader_over(str(root), on_error="skip", rank=r, world_size=2) for r in range(2)]
    try:
        assert len(loaders[0]) == len(loaders[1])
        seen = [i for loader in loaders for batch in loader for i in real(batch, "id")]
        left_out = loaders[1].stats().left_out
    finally:
        for loader in loaders:
            loader.close()
    assert sorted(seen) == [i for i in range(sum(SMALL)) if not 200 <= i < 250]
    assert len(left_out) == 1 and "row group 2" in left_out[0] and "50 rows" in left_out[0]


def test_a_null_image_is_named_or_skipped(tmp_path: Path) -> None:
    P.write_parquet(tmp_path, (20,), 10, null_image=frozenset({7}))
    source = functools.partial(P.image_parquet, urls=str(tmp_path))
    with Loader(source, P.decode_step, batch_size=4, num_workers=1, copy=True) as loader:
        with pytest.raises(Exception, match=r"row group 0, row 7: column 'image' is null"):
            list(loader)
    with Loader(
        source, P.decode_step, batch_size=4, num_workers=1, copy=True, on_error="skip"
    ) as loader:
        seen = {i for batch in loader for i in real(batch, "id")}
    assert seen == set(range(20)) - {7}


def test_reading_writes_nothing_beside_the_data(small: Path) -> None:
    before = sorted(os.listdir(small))
    with loader_over(str(small)) as loader:
        list(loader)
    assert sorted(os.listdir(small)) == before


def _spoil_pages(path: Path, group: int) -> None:
    """Overwrite every column chunk of row group ``group`` with garbage, the file's size and
    footer kept: pages that cannot be decoded (not a file cut short)."""
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path).metadata.row_group(group)
    data = bytearray(path.read_bytes())
    for k in range(meta.num_columns):
        chunk = meta.column(k)
        start, size = chunk.data_page_offset, chunk.total_compressed_size
        data[start : start + size] = bytes((7 * i) % 251 for i in range(size))
    path.write_bytes(bytes(data))


def test_an_undecodable_row_group_is_left_out_whole_under_skip_and_named_under_raise(
    small: Path, tmp_path: Path
) -> None:
    root = tmp_path / "data"
    shutil.copytree(small, root)
    _spoil_pages(root / "train-00000.parquet", 1)  # (rows 100-199: whole batches of them)
    with loader_over(str(root), workers=1) as loader, pytest.raises(Exception) as raised:
        for _batch in loader:
            pass
    assert re.search(
        r"train-00000\.parquet: row group 1 \(bytes \d+-\d+\) cannot be read", str(raised.value)
    ), str(raised.value)
    # (its 100 rows count as skipped: more than the default budget of 1% of an epoch)
    with loader_over(str(root), on_error="skip", max_skipped=100) as loader:
        seen, skipped = [], []
        for batch in loader:
            seen += real(batch, "id")
            skipped += list(batch.info.skipped)
            assert len(batch.info.replaced) + batch.info.padded <= len(batch["id"])
        stats = loader.stats()
    rows = [i for i in range(sum(SMALL)) if not 100 <= i < 200]
    delivered = [i for i in seen if 100 <= i < 200]
    assert not delivered  # (a stand-in row is flagged replaced, never a damaged row)
    assert sorted(set(seen)) == rows
    assert sorted(skipped) == list(range(100, 200))
    assert len(stats.skipped) == 100
    assert all(
        re.search(r"row group 1, row \d+ \(its row group's bytes \d+-\d+ cannot", where)
        for _index, where in stats.skipped
    ), stats.skipped[:3]


@pytest.mark.parametrize("form", ["dataset", "sharded"])
def test_a_null_in_an_optional_column_gets_its_default_and_is_counted(
    tmp_path: Path, form: str
) -> None:
    nulls = frozenset({3, 17, 18, 29})
    path = P.write_captioned(tmp_path, 30, nulls)
    columns = ("image", "caption", "id")
    optional = {"caption": "(none)"}
    if form == "dataset":
        source: Any = ParquetDataset(str(path), columns, optional=optional)
    else:
        source = functools.partial(
            sharded_parquet, urls=str(path), batch_size=4, columns=columns, optional=optional
        )
    with Loader(source, P.caption_step, batch_size=4, num_workers=2, copy=True) as run:
        for epoch in range(2):
            seen = {}
            for batch in run:
                assert not batch.info.skipped
                ids = real(batch, "id")
                seen.update(zip(ids, texts(batch["caption"])[: len(ids)], strict=True))
            assert seen == {i: "(none)" if i in nulls else f"a photo nº{i}" for i in range(30)}
            assert run.stats().defaulted == {"caption": len(nulls) * (epoch + 1)}
        assert run.stats().skipped == ()


def test_a_null_in_a_required_column_is_a_named_skip(tmp_path: Path) -> None:
    path = P.write_captioned(tmp_path, 30, frozenset({17}))
    dataset = ParquetDataset(str(path), ("image", "caption", "id"))
    with Loader(
        dataset, P.caption_step, batch_size=4, num_workers=1, copy=True, on_error="skip"
    ) as run:
        seen = {i for batch in run for i in real(batch, "id")}
        skipped = [name for _id, name in run.stats().skipped]
        assert run.stats().defaulted == {}
    assert seen == set(range(30)) - {17}
    assert len(skipped) == 1 and skipped[0].endswith("captioned.parquet, row group 1, row 7")


def test_the_worker_server_imports_what_the_parquet_definition_opens_before_the_workers(
    tmp_path: Path,
) -> None:
    """The loader's first request names the definition's needs (pyarrow for Parquet); the
    server imports them before it forks the workers, under its own span of the trace."""
    P.write_parquet(tmp_path / "data", [12, 8], 4)
    dataset = ParquetDataset(str(tmp_path / "data"), ("label", "id"))
    with Loader(dataset, P.label_id_step, batch_size=4, num_workers=2) as loader:
        next(iter(loader))
        trace = json.loads(loader.save_trace(tmp_path / "trace.json").read_text())
    events = trace["traceEvents"]
    tracks = {
        e["tid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    server = [e for e in events if e.get("ph") == "X" and tracks.get(e["tid"]) == "worker server"]
    readers = [e for e in server if e["name"] == "the dataset's readers"]
    assert len(readers) == 1, [e["name"] for e in server]
    forks = [e["ts"] for e in events if e.get("ph") == "X" and e["name"] == "worker start"]
    assert forks and readers[0]["ts"] + readers[0]["dur"] <= min(forks) + 1


def test_one_column_gives_its_samples_as_several_columns_give_them(small: Path) -> None:
    """A definition of one column (or one tar member) gives each sample the shape that column
    has beside others: an id (1,), an image's bytes (n,); it gained a leading 1 before."""
    from loader import TarsDataset
    from tests import tar_pipelines as T

    def first_batch(dataset: Any) -> Any:
        with Loader(
            dataset, P.one_output_step, batch_size=4, num_workers=1, copy=True, capture=False
        ) as one:
            return next(iter(one))["value"]

    one_file = str(small / "train-00002.parquet")
    ids = first_batch(ParquetDataset(one_file, columns=("id",)))
    assert np.asarray(ids).shape == (4, 1)
    assert all(380 <= int(v) < 420 for v in np.asarray(ids).ravel())
    images = first_batch(ParquetDataset(one_file, columns=("image",)))
    assert all(np.asarray(image).ndim == 1 for image in images)
    assert all(bytes(np.asarray(image)[:2]) == b"\xff\xd8" for image in images)  # (a JPEG)
    tars = T.write_id_tars(small.parent / "one_member_tars", 12, 6)
    members = first_batch(TarsDataset([str(path) for path in tars], ext=("id",)))
    assert all(np.asarray(member).ndim == 1 for member in members)


def test_a_page_that_fails_its_checksum_is_a_damaged_row_group_not_a_wrong_sample(
    tmp_path: Path,
) -> None:
    """Pages written with a CRC (``write_page_checksum=True``) are checked as they are read: a
    bit flipped in row group 1's ``label`` page names that row group under ``raise`` and leaves
    it out under ``skip``; it was read as a wrong label before."""
    import pyarrow.parquet as pq

    root = tmp_path / "data"
    root.mkdir()
    path = root / "checked.parquet"
    table = P.hf_dataset(range(30)).data.table
    pq.write_table(table, path, row_group_size=10, write_page_checksum=True, compression="none")
    meta = pq.ParquetFile(path).metadata.row_group(1)
    names = [meta.column(k).path_in_schema for k in range(meta.num_columns)]
    chunk = meta.column(names.index("label"))
    data = bytearray(path.read_bytes())
    data[chunk.data_page_offset + chunk.total_compressed_size - 5] ^= 0x01  # (in its values)
    path.write_bytes(bytes(data))
    with loader_over(str(root), workers=1) as loader, pytest.raises(Exception) as raised:
        for batch in loader:  # (a wrong label fails here: labels are the ids mod 3)
            assert real(batch, "label") == [i % 3 for i in real(batch, "id")]
    assert re.search(
        r"checked\.parquet: row group 1 \(bytes \d+-\d+\) cannot be read", str(raised.value)
    ), str(raised.value)
    with loader_over(str(root), workers=1, on_error="skip", max_skipped=10) as loader:
        seen = []
        for batch in loader:
            assert real(batch, "label") == [i % 3 for i in real(batch, "id")]
            seen += real(batch, "id")
    assert sorted(set(seen)) == [i for i in range(30) if not 10 <= i < 20]


def test_a_worker_whose_whole_part_is_a_damaged_row_group_skips_it_under_skip(
    tmp_path: Path,
) -> None:
    """Under skip, a batch none of whose rows loads is filled with a good sample (flagged and
    cut); where a worker's whole part of the epoch is one damaged row group, that sample comes
    from the rest of the dataset (it failed the job: "nothing to fill their rows with")."""
    P.write_parquet(tmp_path, (16,), 8)
    _damage_row_group(tmp_path / "train-00000.parquet", 1)  # (rows 8-15)
    for seed in range(4):  # (the shuffle gives a worker the damaged row group alone in some)
        with loader_over(str(tmp_path), on_error="skip", seed=seed, max_skipped=20) as loader:
            for _epoch in range(2):
                seen = []
                for batch in loader:
                    # (a batch of stand-ins alone keeps one row, flagged replaced)
                    ids = real(batch, "id")
                    seen += [i for row, i in enumerate(ids) if row not in batch.info.replaced]
                assert sorted(seen) == list(range(8)), seed
    # (every row group damaged: no sample to fill with; the data is named at fault, not step())
    _damage_row_group(tmp_path / "train-00000.parquet", 0)
    with loader_over(str(tmp_path), on_error="skip", max_skipped=20) as loader:
        with pytest.raises(RuntimeError, match="no other sample of the dataset loaded") as raised:
            list(loader)
    assert "step() or the pipeline is at fault" not in str(raised.value)


def test_a_local_file_replaced_by_one_of_the_same_size_while_the_job_runs_is_named(
    tmp_path: Path,
) -> None:
    """A file rewritten between epochs with other rows of the same size: its row groups were
    read as the plan's, other samples delivered silently (and a rewrite of another size was
    refused as a damaged row group). Each read checks the file's size and mtime (an fstat)."""
    import os

    import pyarrow as pa
    import pyarrow.parquet as pq

    def write(first: int) -> None:
        ids = list(range(first, first + 20))
        table = pa.table({"label": [i % 3 for i in ids], "id": ids})
        pq.write_table(
            table,
            tmp_path / "a.parquet",
            row_group_size=5,
            use_dictionary=False,
            compression="none",
        )

    write(0)
    with loader_over(str(tmp_path), workers=1) as loader:
        assert sorted(i for batch in loader for i in real(batch, "id")) == list(range(20))
        size = (tmp_path / "a.parquet").stat().st_size
        write(1000)  # (the same size: plain values of the same width)
        assert (tmp_path / "a.parquet").stat().st_size == size
        stat = os.stat(tmp_path / "a.parquet")
        os.utime(tmp_path / "a.parquet", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
        with pytest.raises(Exception, match=r"a\.parquet changed since the job planned") as raised:
            for batch in loader:
                assert max(real(batch, "id")) < 20  # (never one of the new file's rows)
    assert "restart the job" in str(raised.value)
