"""Tar shards without workers: names, patterns, indexes, epoch orders, storage errors."""

from __future__ import annotations

import io
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests import tar_pipelines as T
from workers.sources.plan._epoch_order import EpochOrder, orders_at
from workers.sources.storage import _storage
from workers.sources.tars._index import split_name
from workers.sources.tars._reader import TarOrder, open_shards, parse_ext


def test_brace_patterns_expand_like_webdataset() -> None:
    assert _storage.expand_urls("s3://b/train-{000..002}.tar") == [
        "s3://b/train-000.tar",
        "s3://b/train-001.tar",
        "s3://b/train-002.tar",
    ]
    assert _storage.expand_urls("d/{a,b}-{8..10}.tar") == [
        "d/a-8.tar",
        "d/a-9.tar",
        "d/a-10.tar",
        "d/b-8.tar",
        "d/b-9.tar",
        "d/b-10.tar",
    ]
    with pytest.raises(ValueError, match="first <= last"):
        _storage.expand_urls("t-{5..2}.tar")
    with pytest.raises(ValueError, match="unbalanced"):
        _storage.expand_urls("t-{1..2.tar")
    with pytest.raises(ValueError, match="empty"):
        _storage.expand_urls([])


def test_member_names_split_at_the_first_dot_of_the_file_name() -> None:
    assert split_name("n0144/img.7.jpg") == ("n0144/img", "7.jpg")
    assert split_name("a.b/c.seg.png") == ("a.b/c", "seg.png")
    assert split_name("README") is None
    assert split_name("dir/.hidden") is None
    assert parse_ext(("jpg;png", ".cls")) == [["jpg", "png"], ["cls"]]
    with pytest.raises(ValueError, match="at least one"):
        parse_ext(())


@pytest.mark.parametrize("window", [1, 2, 3, 5])
def test_a_window_order_is_a_permutation_fixed_by_seed_and_epoch(
    tmp_path: Path, window: int
) -> None:
    T.write_id_tars(tmp_path, 30, 7)
    shards = open_shards(str(tmp_path / "train-{000..004}.tar"), None, 0.0)
    assert shards.counts.tolist() == [7, 7, 7, 7, 2]
    positions = np.arange(30)
    order = TarOrder(shards, 1, 9, window).at(positions)
    assert sorted(order.tolist()) == list(range(30))
    assert order.tolist() == TarOrder(shards, 1, 9, window).at(positions).tolist()
    assert order.tolist() != TarOrder(shards, 2, 9, window).at(positions).tolist()
    # positions asked in pieces give the same samples
    pieces = np.concatenate(
        [TarOrder(shards, 1, 9, window).at(p) for p in (positions[:11], positions[11:])]
    )
    assert pieces.tolist() == order.tolist()
    # each group of ``window`` shards is a contiguous run of positions
    shard_of = order // 7
    groups = [set(shard_of[a:b].tolist()) for a, b in _runs(shard_of, window, shards.counts)]
    assert all(len(group) <= window for group in groups)


def test_the_orders_inside_groups_are_each_groups_own_epoch_order() -> None:
    """All groups permuted in one pass give what each group's own order gives (the order of a
    saved run must not move with how it is computed): group ``g`` of ``size`` samples starting
    at ``first`` holds ``first + EpochOrder(size, epoch, key_g).at(offset)``."""
    rng = np.random.default_rng(5)
    for _trial in range(20):
        sizes = rng.integers(1, 40, int(rng.integers(1, 60)))
        epoch, seed = int(rng.integers(0, 4)), int(rng.integers(0, 10**6))
        seeds = [int(s) for s in rng.integers(0, 2**32, len(sizes))]
        group = rng.integers(0, len(sizes), 500)
        offsets = np.array([int(rng.integers(0, sizes[g])) for g in group.tolist()])
        got = orders_at(sizes, seeds, epoch, group, offsets)
        expected = [
            int(EpochOrder(int(sizes[g]), epoch, seeds[g], True).at(np.array([o]))[0])
            for g, o in zip(group.tolist(), offsets.tolist(), strict=True)
        ]
        assert got.tolist() == expected, seed
    assert orders_at(np.array([3]), [1], 0, np.array([], int), np.array([], int)).size == 0


def _runs(shard_of: np.ndarray, window: int, counts: np.ndarray) -> list[tuple[int, int]]:
    """Split positions where the set of shards would exceed ``window`` (greedy)."""
    runs, start, seen = [], 0, set()
    for position, shard in enumerate(shard_of.tolist()):
        if shard not in seen and len(seen) == window:
            runs.append((start, position))
            start, seen = position, set()
        seen.add(shard)
    runs.append((start, len(shard_of)))
    return runs


@pytest.mark.parametrize(("ranks", "workers", "window"), [(1, 3, 2), (2, 4, 4), (3, 2, 1)])
def test_each_worker_reads_its_own_contiguous_piece_of_each_shard(
    tmp_path: Path, ranks: int, workers: int, window: int
) -> None:
    """Given the parts of the layout an epoch starts with, the order keeps each part's samples
    of a shard one contiguous run of it, and no two parts share a sample of a shard: each
    shard's bytes are read once per epoch, however many workers and ranks read it."""
    from workers import Sampling, plan_epoch
    from workers.sources.tars._reader import TarOrders

    T.write_id_tars(tmp_path, 97, 9)  # 11 shards, the last one short
    shards = open_shards(str(tmp_path / "train-{000..010}.tar"), None, 0.0)
    orders = TarOrders(shards, 5, window)
    sampling = Sampling(97, 4, 5, True, False, "")
    plan = plan_epoch(sampling, 2, ranks * workers, None, orders, ranks=ranks)
    taken = []
    for batches in plan:
        real = np.concatenate([ids[: len(ids) - padded] for ids, padded in batches])
        taken += real.tolist()
        for shard in np.unique(real // 9).tolist():  # (ids of shard k: 9k .. 9k + 8)
            mine = np.sort(real[real // 9 == shard])
            assert mine.tolist() == list(range(int(mine[0]), int(mine[-1]) + 1))
        assert len(set((real // 9).tolist())) <= -(-len(real) // 9) + 2 * window
    assert sorted(taken) == list(range(97))  # exactly once
    # the order a layout sets is kept: asked again for the same parts, the same samples
    again = plan_epoch(sampling, 2, ranks * workers, None, orders, ranks=ranks)
    assert all(
        [a.tolist() for a, _ in x] == [b.tolist() for b, _ in y]
        for x, y in zip(plan, again, strict=True)
    )


def test_an_index_is_kept_reused_and_made_again_when_its_tar_changes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    T.write_id_tars(tmp_path, 14, 7)
    caplog.set_level(logging.INFO, logger="workers")
    first = open_shards(str(tmp_path / "train-{000..001}.tar"), None, 0.0)
    assert sum(r.message.startswith("indexed ") for r in caplog.records) == 2
    caplog.clear()
    open_shards(str(tmp_path / "train-{000..001}.tar"), None, 0.5)
    assert not [r for r in caplog.records if r.message.startswith("indexed ")]
    T.write_id_tars(tmp_path, 10, 5)  # rewritten: 5 samples each now
    again = open_shards(str(tmp_path / "train-{000..001}.tar"), None, 0.0)
    assert again.counts.tolist() == [5, 5] and first.counts.tolist() == [7, 7]
    assert sum(r.message.startswith("indexed ") for r in caplog.records) == 2


def test_the_fingerprint_follows_the_shards_not_where_they_are(tmp_path: Path) -> None:
    T.write_id_tars(tmp_path / "a", 14, 7)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    a = open_shards(str(tmp_path / "a" / "train-{000..001}.tar"), None, 0.0)
    b = open_shards(str(tmp_path / "b" / "train-{000..001}.tar"), None, 0.0)
    assert a.fingerprint() == b.fingerprint()
    T.write_id_tars(tmp_path / "b", 14, 7, skip_cls=frozenset({3}))
    c = open_shards(str(tmp_path / "b" / "train-{000..001}.tar"), None, 0.0)
    assert c.fingerprint() == a.fingerprint()  # the same keys and counts
    T.write_id_tars(tmp_path / "b", 16, 8)
    d = open_shards(str(tmp_path / "b" / "train-{000..001}.tar"), None, 0.0)
    assert d.fingerprint() != a.fingerprint()


def _tar(path: Path, names: list[str]) -> None:
    with tarfile.open(path, "w") as tar:
        for name in names:
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"1"))


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (["a.jpg", "b.jpg", "a.cls"], "key 'a' appears again"),
        (["a.jpg", "a.jpg"], "two members with extension 'jpg'"),
        (["a.jpg", "noext"], "has no extension"),
    ],
)
def test_a_shard_with_bad_members_is_refused_naming_them(
    tmp_path: Path, names: list[str], message: str
) -> None:
    _tar(tmp_path / "bad.tar", names)
    with pytest.raises(ValueError, match=f"bad.tar: .*{message}"):
        open_shards(str(tmp_path / "bad.tar"), None, 0.0)


def test_shards_in_two_places_or_listed_twice_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mix local paths and URLs"):
        open_shards(["a.tar", "s3://b/a.tar"], None, 0.0)
    with pytest.raises(ValueError, match="listed twice"):
        open_shards(["a.tar", "a.tar"], None, 0.0)
    with pytest.raises(FileNotFoundError):
        open_shards(str(tmp_path / "none.tar"), None, 0.0)


def test_transient_errors_are_tried_again_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    assert _storage.transient(ConnectionResetError())
    assert _storage.transient(TimeoutError())
    assert _storage.transient(OSError(os.strerror(104)).__class__(104, "reset"))
    assert not _storage.transient(FileNotFoundError())
    assert not _storage.transient(PermissionError())
    assert not _storage.transient(ValueError("bad"))

    class SlowDown(Exception):  # (botocore names throttling this way)
        pass

    assert _storage.transient(SlowDown())
    storage = _storage.RemoteStorage.__new__(_storage.RemoteStorage)
    storage.retries = 2
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError(104, "reset by peer")
        return "data"

    caplog.set_level(logging.WARNING, logger="workers")
    previous, _storage.BACKOFF = _storage.BACKOFF, 0.001
    try:
        assert storage.retried("reading", "s3://b/x.tar", flaky) == "data"
        calls.clear()
        storage.retries = 1
        with pytest.raises(OSError, match=r"^s3://b/x\.tar: reading failed: ConnectionResetError"):
            storage.retried("reading", "s3://b/x.tar", flaky)
    finally:
        _storage.BACKOFF = previous
    assert sum("trying again" in r.message for r in caplog.records) == 3


def _write_shards(source: Path, target: Path, *command: str) -> subprocess.CompletedProcess[str]:
    """``python -m loader.tars [command] --from source --to target --samples-per-shard 20``."""
    arguments = [*command, "--from", str(source), "--to", str(target), "--samples-per-shard", "20"]
    return subprocess.run(
        [sys.executable, "-m", "loader.tars", *arguments], capture_output=True, text=True
    )


@pytest.mark.parametrize("command", [(), ("write",)], ids=["no-command", "write"])
def test_the_command_line_writes_shards_with_indexes_and_refuses_a_missing_folder(
    image_root: Path, tmp_path: Path, command: tuple[str, ...]
) -> None:
    from workers.sources.tars._summary import SUMMARY, decode

    done = _write_shards(image_root, tmp_path, *command)
    assert done.returncode == 0, done.stderr
    assert "wrote 3 shards" in done.stdout and "train-{000000..000002}.tar" in done.stdout
    for k in range(3):  # each shard's index beside it, as DALI's tool writes it
        tar = tmp_path / f"train-{k:06d}.tar"
        assert tar.with_suffix(".idx").read_bytes() == _wds2idx(tar, tmp_path / "theirs.idx")
    summary = decode((tmp_path / SUMMARY).read_bytes(), SUMMARY)
    assert [e.samples for _name, e in sorted(summary.items())] == [20, 20, 8]
    shards = open_shards(str(tmp_path / "train-{000000..000002}.tar"), None, 0.0)
    assert shards.counts.tolist() == [20, 20, 8]
    failed = _write_shards(tmp_path / "none", tmp_path, *command)
    assert failed.returncode == 2 and "does not exist" in failed.stderr


def test_remote_shards_are_read_one_range_per_shard_not_one_request_per_sample(
    tmp_path: Path,
) -> None:
    """Over fsspec's in-memory filesystem (a remote storage to the loader): an epoch planned
    with ``expect`` reads each shard once, ahead, and every sample comes out right."""
    import fsspec

    from workers.sources.tars._reader import TarLoader, TarOrder

    memory = fsspec.filesystem("memory")
    for path in T.write_id_tars(tmp_path, 30, 7):
        memory.pipe(f"/shards-{os.getpid()}/{path.name}", path.read_bytes())
    try:
        shards = open_shards(f"memory://shards-{os.getpid()}/train-{{000..004}}.tar", None, 0.0)
        assert not shards.storage.local
        loader = TarLoader(shards, parse_ext(("cls", "id")), 1, ["cls", "id"])
        reads: list[tuple[str, int, int]] = []
        read = shards.storage.read

        def counted(path: str, start: int, end: int, expect: Any = None) -> np.ndarray:
            reads.append((path, start, end))
            return read(path, start, end, expect)

        shards.storage.read = counted  # type: ignore[method-assign]
        ids = TarOrder(shards, 0, 3, 2).at(np.arange(30))
        batches = [ids[k : k + 4] for k in range(0, 30, 4)]
        loader.expect(0, batches)
        for step, batch in enumerate(batches):
            for index in batch.tolist():
                cls, got = loader(index)
                assert int(got[0]) == index and int(cls[0]) == index % 3
            loader.passed(0, step)
        assert sorted(path for path, _start, _end in reads) == sorted(
            f"memory://shards-{os.getpid()}/train-{k:03d}.tar" for k in range(5)
        )
    finally:
        memory.rm(f"/shards-{os.getpid()}", recursive=True)


# -- indexes beside the shards (DALI's wds2idx format) and the summary ---------------------------


def _wds2idx(tar: Path, out: Path) -> bytes:
    """DALI's own tool on ``tar`` (installed with DALI as ``wds2idx``)."""
    tool = shutil.which("wds2idx") or str(Path(sys.executable).with_name("wds2idx"))
    if not Path(tool).exists():
        pytest.skip("DALI's wds2idx is not installed")
    subprocess.run([tool, str(tar), str(out)], check=True, capture_output=True)
    return out.read_bytes()


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
        theirs = _wds2idx(path, tmp_path / "theirs.idx")
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
    shards = open_shards([str(p) for p in paths], None, 0.0)  # (no index yet: scanned, written)
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
    text = _wds2idx(path, tmp_path / "train-000.idx").decode()
    assert "cls 1536 1 group0/s00000.cls" in text.split("\n")[1]
    bad = spoil(text)  # type: ignore[operator]
    with pytest.raises(ValueError, match=message):
        parse_idx(str(path), "x.idx", bad.encode())
    (tmp_path / "train-000.idx").write_text(bad)
    caplog.set_level(logging.INFO, logger="workers")
    shards = open_shards(str(path), None, 0.0)
    assert shards.counts.tolist() == [7]
    assert [r for r in caplog.records if "ignored" in r.message and "train-000.idx" in r.message]
    assert [r for r in caplog.records if r.message.startswith("indexed ")]
    assert (tmp_path / "train-000.idx").read_bytes() == _wds2idx(path, tmp_path / "again.idx")


def _memory_shards(tmp_path: Path, total: int, per_shard: int) -> tuple[str, object, list[Path]]:
    """Shards in fsspec's in-memory filesystem (a remote store to the loader)."""
    import fsspec

    memory = fsspec.filesystem("memory")
    root = f"/tars-{os.getpid()}-{tmp_path.name}"
    paths = T.write_id_tars(tmp_path / "local", total, per_shard)
    for path in paths:
        memory.pipe(f"{root}/{path.name}", path.read_bytes())
    return f"memory:/{root}", memory, paths


class _Counted:
    """Counts a storage's reads of whole objects (indexes, summaries) and of byte ranges."""

    def __init__(self, storage: object) -> None:
        self.whole: list[str] = []
        self.ranges: list[str] = []
        read_all, read = storage.read_all, storage.read  # type: ignore[attr-defined]

        def counted_all(path: str) -> bytes:
            self.whole.append(path)
            return read_all(path)  # type: ignore[no-any-return]

        def counted(path: str, start: int, end: int, expect: Any = None) -> np.ndarray:
            self.ranges.append(path)
            return read(path, start, end, expect)  # type: ignore[no-any-return]

        storage.read_all, storage.read = counted_all, counted  # type: ignore[attr-defined]
        self.undo = lambda: setattr(storage, "read_all", read_all) or setattr(storage, "read", read)


def test_with_a_summary_a_worker_reads_no_index_until_it_reads_a_shard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from workers.sources.storage import CACHE_DIR_ENV
    from workers.sources.storage import storage_for
    from workers.sources.tars._summary import SUMMARY

    root, memory, _paths = _memory_shards(tmp_path, 30, 7)
    pattern = f"{root}/train-{{000..004}}.tar"
    try:
        first = open_shards(pattern, None, 0.0, lead=True)  # scans, writes .idx and the summary
        names = sorted(p.rsplit("/", 1)[1] for p in memory.ls(root.split(":/", 1)[1], detail=False))
        assert names == [SUMMARY] + [f"train-{k:03d}.{e}" for k in range(5) for e in ("idx", "tar")]
        monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "fresh-cache"))  # (another node)
        counted = _Counted(storage_for(pattern))
        try:
            again = open_shards(pattern, None, 0.5)
            assert counted.whole == [f"{root}/{SUMMARY}"] and not counted.ranges
            assert again.fingerprint() == first.fingerprint()
            assert again.counts.tolist() == [7, 7, 7, 7, 2]
            # the index of one shard comes when that shard is read, not before
            from workers.sources.tars._reader import TarLoader

            loader = TarLoader(again, parse_ext(("cls", "id")), 1, ["cls", "id"])
            cls, got = loader(int(again.starts[3]) + 1)
            assert int(got[0]) == 22 and int(cls[0]) == 22 % 3
            assert counted.whole[1:] == [f"{root}/train-003.idx"]
        finally:
            counted.undo()
    finally:
        memory.rm(root.split(":/", 1)[1], recursive=True)


def test_a_stale_summary_is_named_and_the_changed_shards_are_read_again(tmp_path: Path) -> None:
    from workers.sources.tars._summary import SUMMARY, decode

    paths = T.write_id_tars(tmp_path, 28, 7)
    pattern = str(tmp_path / "train-{000..003}.tar")
    open_shards(pattern, None, 0.0, lead=True)
    T.write_id_tars(tmp_path / "other", 10, 5)  # train-001 rewritten with 5 samples
    shutil.copy(tmp_path / "other" / "train-001.tar", paths[1])
    with pytest.warns(
        UserWarning,
        match=rf"summary {tmp_path}/{SUMMARY} is stale: 1 shard.*"
        r"train-001\.tar \(size 10240 -> 10240\)|train-001\.tar \(mtime",
    ):
        changed = open_shards(pattern, None, 0.0, lead=True)
    assert changed.counts.tolist() == [7, 5, 7, 7]
    entries = decode((tmp_path / SUMMARY).read_bytes(), SUMMARY)
    assert entries["train-001.tar"].samples == 5  # rewritten by the lead worker
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert open_shards(pattern, None, 0.0, lead=True).counts.tolist() == [7, 5, 7, 7]
    # a shard the summary does not cover is opened from its own index; a missing one is named
    T.write_id_tars(tmp_path / "more", 35, 7)
    shutil.copy(tmp_path / "more" / "train-004.tar", tmp_path / "train-004.tar")
    five = open_shards(str(tmp_path / "train-{000..004}.tar"), None, 0.0, lead=True)
    assert five.counts.tolist() == [7, 5, 7, 7, 7]
    (tmp_path / "train-002.tar").unlink()
    with pytest.raises(FileNotFoundError, match=r"train-002\.tar"):
        open_shards(str(tmp_path / "train-{000..004}.tar"), None, 0.0)


def test_the_index_command_indexes_once_and_finishes_an_interrupted_run(tmp_path: Path) -> None:
    from workers.sources.storage import CACHE_DIR_ENV
    from workers.sources.tars._summary import SUMMARY, decode

    T.write_id_tars(tmp_path, 40, 5)
    pattern = str(tmp_path / "train-{000..007}.tar")

    def index(cache: str | None = None) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "loader.tars", "index", pattern, "--workers", "2"]
        env = dict(os.environ, **({CACHE_DIR_ENV: cache} if cache else {}))
        return subprocess.run(command, capture_output=True, text=True, env=env)

    done = index()
    assert done.returncode == 0, done.stderr
    assert "[8/8] 100.0%  scanned 8" in done.stdout and "8 of 8 shards indexed" in done.stdout
    assert sorted(p.name for p in tmp_path.glob("*.idx")) == [
        f"train-{k:03d}.idx" for k in range(8)
    ]
    assert sum(e.samples for e in decode((tmp_path / SUMMARY).read_bytes(), "s").values()) == 40
    again = index()
    assert "scanned 0" in again.stdout and "8 up to date" in again.stdout
    # an interrupted run: 3 indexes missing, the summary gone: 3 scans, 5 indexes read
    for k in (1, 4, 6):
        (tmp_path / f"train-{k:03d}.idx").unlink()
    (tmp_path / SUMMARY).unlink()
    finished = index(cache=str(tmp_path / "another-node"))
    assert "scanned 3" in finished.stdout and "read 5 .idx" in finished.stdout, finished.stdout
    assert len(decode((tmp_path / SUMMARY).read_bytes(), "s")) == 8
    # on the node that made them, missing indexes come from its cache, not from a scan
    (tmp_path / "train-002.idx").unlink()
    cached = index()
    assert "scanned 0" in cached.stdout and "1 from this node's cache" in cached.stdout
    assert (tmp_path / "train-002.idx").exists()
    bad = subprocess.run(
        [sys.executable, "-m", "loader.tars", "index", pattern, "--storage-options", "{x"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "--storage-options is not JSON" in bad.stderr


@pytest.mark.parametrize("seekable", [True, False])
def test_a_damaged_shard_keeps_its_whole_samples_before_the_damage(
    tmp_path: Path, seekable: bool
) -> None:
    """Cut anywhere, a shard gives the samples whose members all lie before the cut (never a
    sample missing a member), and the error a strict scan raises; garbage gives none."""
    from workers.sources.tars._index import scan, scan_whole_samples

    T.write_id_tars(tmp_path, 7, 7)
    data = (tmp_path / "train-000.tar").read_bytes()
    full = scan(str(tmp_path / "train-000.tar"), io.BytesIO(data), seekable=True)
    ends = [  # where each sample's last member ends
        int((full.member_offset + full.member_size)[full.member_sample == k].max())
        for k in range(full.samples)
    ]
    for cut in range(0, ends[-1] + 1024, 97):  # (after the end-of-archive blocks: whole)
        stream = io.BytesIO(data[:cut])
        if not seekable:  # (a remote shard is read as a stream)
            stream.seekable = lambda: False  # type: ignore[method-assign]
        index, damage = scan_whole_samples("t.tar", stream, seekable=seekable, size=cut)
        assert damage is not None and "t.tar" in str(damage)
        assert index.samples <= sum(end <= cut for end in ends)
        assert index.samples >= sum(end <= cut for end in ends) - 1  # (the cut one's neighbour)
        for k in range(index.samples):  # each kept sample is whole
            assert (index.member_sample == k).sum() == (full.member_sample == k).sum()
    index, damage = scan_whole_samples("t.tar", io.BytesIO(b"not a tar" * 200), seekable=seekable)
    assert index.samples == 0 and "not a whole tar" in str(damage)


@pytest.mark.parametrize(
    ("ahead_bytes", "sizes", "fetched"),
    [
        (None, [10, 10, 10, 10, 10], [0, 1, 2, 3]),  # ahead=3 shards: the count alone
        (25, [10, 10, 10, 10, 10], [0, 1, 2]),  # 2 shards fit the budget
        (15, [10, 10, 10, 10, 10], [0, 1]),
        (15, [10, 100, 10, 10, 10], [0, 1]),  # the first shard ahead, whatever its size
        (1000, [1, 1, 1, 1, 1], [0, 1, 2, 3]),  # tiny shards: still no more than ahead=3
    ],
)
def test_read_ahead_is_bounded_in_shards_and_in_bytes_past_the_first(
    ahead_bytes: int | None, sizes: list[int], fetched: list[int]
) -> None:
    """``ahead`` (shards) and ``ahead_bytes`` bound what a worker fetches before it needs it;
    the shard the batch being loaded needs is fetched whatever the bounds."""
    from workers.sources.tars._reader import _Fetcher

    def fetch(shard: int, rows: Any) -> tuple[int, np.ndarray]:
        return 0, np.zeros(1, np.uint8)

    fetcher = _Fetcher(fetch, 3, ahead_bytes, lambda shard, rows: sizes[shard])
    try:
        # shard k is first needed at step k and last at step k + 9 (a lead of 5 steps)
        fetcher.plan([(k, k, k + 9, np.arange(4)) for k in range(5)])
        assert sorted(fetcher._buffers) == fetched
    finally:
        fetcher.close()


def _tar_bytes(form: int, names: list[str], seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=form) as tar:
        for name in names:
            payload = rng.bytes(int(rng.integers(0, 3000)))
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
        folder = tarfile.TarInfo("folder/")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)
    return buffer.getvalue()


@pytest.mark.parametrize("form", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_a_shard_read_whole_is_indexed_from_its_headers_as_tarfile_reads_it(form: int) -> None:
    """The fast reading of a whole shard's headers gives what ``tarfile`` gives, or stands
    aside (long names, pax headers) and lets it read; a shard cut short or with a damaged
    header is never taken as whole by it."""
    from workers.sources.tars._index import _members, _plain_members, scan

    def by_tarfile(data: bytes) -> tuple[Any, Any]:
        members, _offset, damage = _members("t.tar", io.BytesIO(data), seekable=True, size=None)
        return members, damage

    rng = np.random.default_rng(form)
    plain = [f"s{i:04d}.jpg" for i in range(30)]
    for names in (
        plain,
        [f"{'x' * 120}/s{i}.cls" for i in range(4)],
        [f"é{i}.id" for i in range(4)],
    ):
        data = _tar_bytes(form, names, seed=len(names))
        fast = _plain_members(data)
        members, damage = by_tarfile(data)
        assert damage is None
        if names is plain or form == tarfile.USTAR_FORMAT:
            assert fast == members  # (ustar splits a long name into its prefix field)
        assert fast is None or fast == members
        assert scan("t.tar", io.BytesIO(data), seekable=True).samples == len(names)
        variants = [data[:cut] for cut in (len(data) - 1, len(data) - 1024, len(data) // 2, 700)]
        for at in rng.choice(len(data), 40, replace=False).tolist():
            damaged = bytearray(data)
            damaged[at] ^= 0x41
            variants.append(bytes(damaged))
        for variant in variants:
            fast = _plain_members(variant)
            members, damage = by_tarfile(variant)
            assert fast is None or (damage is None and fast == members)


@pytest.mark.parametrize("local", [False, True])
def test_a_shards_directory_and_name_are_worked_out_once_as_the_storage_splits_them(
    local: bool,
) -> None:
    """The start splits each shard's URL once (``places_of``), the same as the storage's own
    ``dirname`` and ``basename``, odd URLs included."""
    from workers.sources.tars._shards import places_of

    remote = [
        "s3://bucket/train-0.tar",
        "s3://bucket/a/b/c/train-1.tar",
        "s3://bucket//doubled.tar",
        "s3://bucket/a//b.tar",
        "s3://top.tar",
        "gs://bucket/dir/",
        "az://bucket/ü nicode/x y.tar",
    ]
    paths = ["/data/train-0.tar", "relative/x.tar", "x.tar", "/data//y.tar", "/z.tar"]
    storage = (
        _storage.LocalStorage() if local else _storage.RemoteStorage.__new__(_storage.RemoteStorage)
    )
    urls = paths if local else remote
    assert places_of(storage, urls) == [(storage.dirname(u), storage.basename(u)) for u in urls]
