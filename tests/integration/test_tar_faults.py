"""Hostile data in tar shards, as a matrix: each kind of fault x ``on_error`` ("skip", "raise") x
where the shards are (a local directory; a bucket of a real S3-protocol server, moto's, on
127.0.0.1, read by real s3fs in the workers). Every cell ends one of two ways within 30 s: every
good sample read exactly once (with its own label), or one clear error naming the file; and
nothing leaks (the suite's autouse check). A kind of fault is one :class:`Fault` in
:data:`FAULTS`: one more there is one more row of the matrix."""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import re
import tarfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loader import ImageTooLargeError, Loader
from tests import tar_pipelines as T
from workers.sources.storage import StorageFailure
from workers.sources.tars._summary import SUMMARY

pytestmark = pytest.mark.timeout(120)

TOTAL = 12  # 3 shards of 4 samples, the fault in the second: train-001.tar (ids 4-7)
SHARDS = "train-{000..002}.tar"
AT = "<at>"  # in a message's pattern: where the shards are (a directory, s3://bucket)
#: Seconds a cell may take, from the Loader's start to its end or its error.
CELL_SECONDS = 30.0


def id_shards(directory: Path) -> list[Path]:
    """Good shards of ``TOTAL`` samples (``<key>.id``, then ``<key>.cls``: ``id % 3``), each
    with its ``.idx``."""
    paths = T.write_id_tars(directory, TOTAL, 4)
    T.write_idx(paths)
    return paths


@dataclass(frozen=True)
class Fault:
    """One kind of hostile data: how it spoils a directory of good shards (``write``), what the
    summary put beside them says, and what a job over them must do, per ``on_error``: stop with
    an error (``stops``), or go on and read ``read``, each once."""

    name: str
    #: spoils the directory ``write`` wrote, before it is put in place
    spoil: Callable[[Path], None]
    #: the summary beside the shards (of those with an ``.idx``): its lies (shard name ->
    #: sample count; empty: it tells the truth); None: no summary
    summary: dict[str, int] | None = field(default_factory=dict)
    #: per ``on_error``: the error the job stops with, its type and a pattern of its message
    #: (``<at>``: where the shards are), at the start or during the epoch
    stops: dict[str, tuple[type[BaseException], str]] = field(default_factory=dict)
    #: the ids a job that goes on reads, each exactly once
    read: frozenset[int] = frozenset(range(TOTAL))
    #: where the job goes on: a pattern of a warning (or WARNING log line) it gives
    said: str = ""
    #: where the job goes on: a pattern of its one ``loader.stats().left_out`` line (None: none)
    left_out: str | None = None
    #: where the job goes on: the keys of the samples of train-001.tar it skips, each named once
    #: in ``batch.info.skipped_names`` (their rows repeat good samples: not counted as read)
    skipped: frozenset[str] = frozenset()
    #: the most memory a worker may have held at its peak (VmHWM), where the job goes on
    peak_bytes: int | None = None
    write: Callable[[Path], list[Path]] = id_shards
    source: Callable[..., Any] = T.id_tars
    step: Callable[..., Any] = T.cls_id_step


def png_id_shards(directory: Path) -> list[Path]:
    """:func:`id_shards` with a small PNG (``<key>.png``) after each sample's other members."""
    from PIL import Image

    paths = id_shards(directory)
    picture = io.BytesIO()
    Image.new("L", (8, 8), 7).save(picture, "PNG")
    for path in paths:
        with tarfile.open(path) as tar:
            members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]  # type: ignore[union-attr]
        with tarfile.open(path, "w") as tar:
            for number, (member, data) in enumerate(members):
                tar.addfile(member, io.BytesIO(data))
                if number % 2:  # (after .cls, the sample's last member)
                    png = tarfile.TarInfo(member.name.rsplit(".", 1)[0] + ".png")
                    png.size = len(picture.getvalue())
                    tar.addfile(png, io.BytesIO(picture.getvalue()))
    T.write_idx(paths)
    return paths


def _png_bomb(directory: Path) -> None:
    """Sample 6's PNG becomes a 24000 x 24000 bomb (about 70 KB; 576 M pixels decoded)."""
    from tests.integration.test_image_bombs import write_png_bomb

    path = directory / "train-001.tar"
    bomb = directory / "bomb.png"
    write_png_bomb(bomb)
    with tarfile.open(path) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]  # type: ignore[union-attr]
    with tarfile.open(path, "w") as tar:
        for member, data in members:
            if member.name == "group0/s00006.png":
                data = bomb.read_bytes()
                member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    bomb.unlink()
    T.write_idx([path])


def _lying_idx(directory: Path) -> None:
    T.lie_in_idx(directory / "train-001.idx", "overlap")


def _link_member(directory: Path) -> None:
    T.with_link_member(directory / "train-001.tar", 2)  # (ids 4 and 5 are whole before it)
    (directory / "train-001.idx").unlink()  # (no index of it can be made)


_SUMMARY_LIES = (
    StorageFailure,
    rf"the summary {AT}/{SUMMARY} is wrong about {AT}/train-001\.tar: it says the shard holds "
    rf"5 samples .*, the shard holds 4 samples .*python -m loader\.tars index "
    rf"'{AT}/train-001\.tar' --force",
)
_BOMB = (
    rf"{AT}/train-001\.tar:group0/s00006\.png: a 24000x24000 PNG image, 576,000,000 pixels, "
    "over max_image_pixels=89,478,485"
)
_LINK = rf"{AT}/train-001\.tar: member 'group0/s00006\.id' at byte \d+ is not a regular file"

FAULTS = [
    Fault(
        "lying-idx",  # the second sample's entries point at the first one's bytes
        _lying_idx,
        summary=None,  # (its .idx is read at the start)
        said=rf"ignored {AT}/train-001\.idx \(.* line 3: member 'group1/s00005\.id' at byte 512 "
        "overlaps",
    ),
    Fault(
        "link-member",  # a symbolic link where sample 6's first member should be
        _link_member,
        stops={"raise": (ValueError, _LINK)},
        read=frozenset(range(TOTAL)) - {6, 7},
        said=rf"on_error='skip': {_LINK}.* its first 2 samples are read .*the rest of it, from "
        "sample 'group0/s00006' at byte",
        left_out=rf"{_LINK}.*first 2 samples are read",
    ),
    Fault(
        "summary-lies",  # it says 5 samples where the unchanged shard holds 4
        lambda directory: None,
        summary={"train-001.tar": 5},
        stops={"skip": _SUMMARY_LIES, "raise": _SUMMARY_LIES},
    ),
    Fault(
        "png-bomb",  # sample 6's PNG decodes to 576 M pixels: skipped or named, never decoded
        _png_bomb,
        stops={"raise": (ImageTooLargeError, _BOMB)},
        read=frozenset(range(TOTAL)) - {6},
        skipped=frozenset({"group0/s00006"}),
        write=png_id_shards,
        source=T.png_id_tars,
        step=T.png_cls_id_step,
        peak_bytes=2**30,
    ),
]


class Place:
    """Where a cell's shards are: a directory, as they were written."""

    options: dict[str, Any] | None = None

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.at = str(directory)

    def put(self) -> None:
        """Put the directory's files in place (here they are)."""

    def put_summary(self, data: bytes) -> None:
        (self.directory / SUMMARY).write_bytes(data)

    def identity(self, path: Path) -> tuple[int, str]:
        from workers.sources.storage import storage_for

        return storage_for(str(path)).identity(str(path))


class Bucket(Place):
    """A bucket of its own on ``server`` (nothing another cell wrote, in the store or in this
    node's cache), with the directory's files uploaded."""

    def __init__(self, directory: Path, server: Any) -> None:
        super().__init__(directory)
        self.server, self.name = server, f"faults-{uuid.uuid4().hex[:12]}"
        self.at, self.options = f"s3://{self.name}", server.options()
        server.bucket(self.name)

    def put(self) -> None:
        client = self.server.client()
        try:
            for path in sorted(self.directory.iterdir()):
                client.upload_file(str(path), self.name, path.name)
        finally:
            client.close()

    def put_summary(self, data: bytes) -> None:
        client = self.server.client()
        try:
            client.put_object(Bucket=self.name, Key=SUMMARY, Body=data)
        finally:
            client.close()

    def identity(self, path: Path) -> tuple[int, str]:
        client = self.server.client()
        try:
            head = client.head_object(Bucket=self.name, Key=path.name)
        finally:
            client.close()
        return int(head["ContentLength"]), f"ETag:{head['ETag'].strip(chr(34))}"


@contextlib.contextmanager
def places(kind: str, tmp_path: Path) -> Iterator[Callable[[str], Place]]:
    """Makes a fresh place per cell: a directory, or a bucket on this test's server."""
    if kind == "local":
        yield lambda name: Place(tmp_path / name)
        return
    pytest.importorskip("boto3")
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    from bench._s3 import S3Server

    server = S3Server(threaded=True)
    try:
        yield lambda name: Bucket(tmp_path / name, server)
    finally:
        server.close()


@dataclass
class Outcome:
    """What a cell's job did: its ids (rows replaced under skip left out) or its error."""

    ids: list[int] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    left_out: tuple[str, ...] = ()
    error: BaseException | None = None
    said: list[str] = field(default_factory=list)
    seconds: float = 0.0
    peak_bytes: int = 0  # the largest worker's peak resident memory (VmHWM)


def run_cell(fault: Fault, place: Place, on_error: str, caplog: Any) -> Outcome:
    """Write the fault's shards into ``place``, then one epoch of a loader of 2 workers over
    them (or its error)."""
    paths = fault.write(place.directory)
    fault.spoil(place.directory)
    place.put()
    if fault.summary is not None:  # (of the shards with an index, as they are in place)
        indexed = [p for p in paths if p.with_suffix(".idx").exists()]
        place.put_summary(T.summary_of(indexed, place.identity, fault.summary))
    source = functools.partial(
        fault.source, urls=f"{place.at}/{SHARDS}", storage_options=place.options
    )
    outcome = Outcome()
    caplog.clear()
    started = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with Loader(
                source, fault.step, batch_size=4, num_workers=2, on_error=on_error, copy=True
            ) as loader:
                for batch in loader:
                    ids = np.asarray(batch["id"]).ravel().tolist()
                    labels = np.asarray(batch["cls"]).ravel().tolist()
                    for row in range(len(ids) - batch.info.padded):
                        if row in batch.info.replaced:  # (a repeat of a good sample)
                            continue
                        assert labels[row] == ids[row] % 3, f"sample {ids[row]}: another's label"
                        outcome.ids.append(int(ids[row]))
                    outcome.skipped += batch.info.skipped_names
                outcome.left_out = loader.stats().left_out
                outcome.peak_bytes = max(map(_peak_rss, loader.worker_pids()), default=0)
        except AssertionError:
            raise
        except Exception as error:
            outcome.error = error
    outcome.seconds = time.monotonic() - started
    outcome.said = [str(w.message) for w in caught]
    outcome.said += [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    return outcome


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


@pytest.mark.parametrize("where", ["local", "s3"])
@pytest.mark.parametrize("fault", FAULTS, ids=[fault.name for fault in FAULTS])
def test_hostile_data_gives_every_good_sample_once_or_one_error_naming_the_file(
    fault: Fault, where: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="loader")
    with places(where, tmp_path) as place_for:
        for on_error in ("skip", "raise"):
            place = place_for(on_error)
            outcome = run_cell(fault, place, on_error, caplog)
            cell = f"{fault.name} x on_error={on_error} x {where}"
            at = re.escape(place.at)
            assert outcome.seconds < CELL_SECONDS, (cell, outcome.seconds)
            stops = fault.stops.get(on_error)
            if stops is not None:
                kind, pattern = stops
                assert isinstance(outcome.error, kind), (cell, outcome.error)
                assert re.search(pattern.replace(AT, at), str(outcome.error)), (cell, outcome.error)
                continue
            assert outcome.error is None, (cell, outcome.error)
            assert sorted(outcome.ids) == sorted(fault.read), (cell, sorted(outcome.ids))
            assert sorted(outcome.skipped) == sorted(
                f"{place.at}/train-001.tar:{key}" for key in fault.skipped
            ), (cell, outcome.skipped)
            if fault.peak_bytes is not None:
                assert 0 < outcome.peak_bytes < fault.peak_bytes, (cell, outcome.peak_bytes)
            if fault.said:
                said = [m for m in outcome.said if re.search(fault.said.replace(AT, at), m)]
                assert said, (cell, outcome.said)
            if fault.left_out is None:
                assert not outcome.left_out, (cell, outcome.left_out)
            else:
                assert len(outcome.left_out) == 1, (cell, outcome.left_out)
                assert re.search(fault.left_out.replace(AT, at), outcome.left_out[0]), (
                    cell,
                    outcome.left_out,
                )


# A shard changed after `python -m loader.tars index` (or with no index at all), per store: the
# table "damage -> answer" of docs/datasets.md#errors, each cell a test. train-001.tar holds ids
# 4-7, 2048 bytes a sample.
STORES = ["local", "local-indexed", "s3-indexed", "s3"]


def _truncate(path: Path) -> None:  # inside sample 6: ids 4 and 5 whole
    path.write_bytes(path.read_bytes()[:5000])


def _grow(path: Path) -> None:  # one more sample: id 12
    with tarfile.open(path, "a") as tar:
        for ext, text in (("id", "12"), ("cls", "0")):
            info = tarfile.TarInfo(f"group0/s00012.{ext}")
            info.size = len(text)
            tar.addfile(info, io.BytesIO(text.encode()))


def _rewrite(path: Path) -> None:  # other samples: ids 20-23
    other = T.write_id_tars(path.parent.parent / f"other-{path.parent.name}", 24, 4)[5]
    path.write_bytes(other.read_bytes())


DAMAGES = {"truncated": _truncate, "grew": _grow, "rewritten": _rewrite}
_NOT_WHOLE = rf"{AT}/train-001\.tar is not a whole tar file"


def _answer(damage: str, store: str, on_error: str) -> tuple[Any, frozenset[int], str]:
    """(the error type and pattern, or None; the ids read; a pattern of a warning) of a cell."""
    indexed, every = store.endswith("-indexed"), frozenset(range(TOTAL))
    if damage == "truncated":
        if on_error == "raise":
            if store == "s3-indexed":
                pattern = rf"{_NOT_WHOLE}: it ends at byte 5000, where the summary {AT}/{SUMMARY}"
                return (
                    (ValueError, pattern + r" .*says 10240 .*python -m loader\.tars index"),
                    every,
                    "",
                )
            return (ValueError, _NOT_WHOLE), every, ""
        said = r"on_error='skip': .*train-001\.tar.* first 2 samples are read"
        return None, every - {6, 7}, said
    if damage == "grew":
        if indexed:
            return None, every, r"train-001\.tar"
        return None, every | {12}, ""
    if store == "s3-indexed":  # rewritten: the epochs were planned with other samples
        pattern = (
            rf"{AT}/train-001\.tar changed since it was indexed .*python -m loader\.tars index"
        )
        return (StorageFailure, pattern), every, ""
    return None, (every - {4, 5, 6, 7}) | {20, 21, 22, 23}, r"train-001\.tar" if indexed else ""


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_shard_changed_after_indexing_gets_the_same_answer_on_every_store(
    damage: str, store: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="loader")
    indexed = store.endswith("-indexed")
    with places(store.partition("-")[0], tmp_path) as place_for:
        for on_error in ("skip", "raise"):
            place = place_for(on_error)
            paths = id_shards(place.directory)
            if not indexed:
                for path in paths:
                    path.with_suffix(".idx").unlink()
            place.put()
            if indexed:
                place.put_summary(T.summary_of(paths, place.identity))
                time.sleep(0.01)  # (a local rewrite's mtime differs)
            DAMAGES[damage](place.directory / "train-001.tar")
            if place.options is not None:  # (the bucket: the shard replaced)
                shard = place.directory / "train-001.tar"
                client = place.server.client()  # type: ignore[attr-defined]
                try:
                    client.upload_file(str(shard), place.name, shard.name)  # type: ignore[attr-defined]
                finally:
                    client.close()
            outcome = run_cell(
                Fault(damage, lambda d: None, summary=None, write=lambda d: []),
                place,
                on_error,
                caplog,
            )
            cell = f"{damage} x on_error={on_error} x {store}"
            at = re.escape(place.at)
            stops, read, said = _answer(damage, store, on_error)
            if stops is not None:
                kind, pattern = stops
                assert isinstance(outcome.error, kind), (cell, outcome.error)
                assert re.search(pattern.replace(AT, at), str(outcome.error)), (cell, outcome.error)
                continue
            assert outcome.error is None, (cell, outcome.error)
            assert sorted(set(outcome.ids)) == sorted(read), (cell, sorted(outcome.ids))
            assert len(outcome.ids) == len(read), (cell, sorted(outcome.ids))
            if said:
                assert [m for m in outcome.said if re.search(said, m)], (cell, outcome.said)
            if damage == "truncated":  # (S3 after index: found by the read, the same line)
                assert len(outcome.left_out) == 1 and "first 2 samples" in outcome.left_out[0], (
                    cell,
                    outcome.left_out,
                )
