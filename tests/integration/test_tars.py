"""sharded_tars over local WebDataset shards: every guarantee of sharded_source, through workers."""

from __future__ import annotations

import functools
import itertools
import json
import logging
import re
import tarfile
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loader import Loader, StartupError, write_tars
from loader.sample import list_images
from tests import tar_pipelines as T
from workers.sources.storage import storage_for
from workers.sources.tars._summary import cached_summary_path

pytestmark = pytest.mark.timeout(240)

TOTAL = 30  # id tars: 30 samples, 7 per shard (5 shards, the last one of 2)


def real(batch: Any, name: str) -> list[int]:
    values = [int(v) for v in np.asarray(batch[name]).ravel()]
    return values[: len(values) - batch.info.padded]


def loader_over(urls: Any, workers: int = 2, **kw: Any) -> Loader:
    options = {k: kw.pop(k) for k in ("shuffle_window", "ahead", "storage_options") if k in kw}
    source = functools.partial(T.id_tars, urls=urls, **options)
    return Loader(source, T.cls_id_step, batch_size=4, num_workers=workers, copy=True, **kw)


def test_write_tars_gives_webdataset_shards_every_image_read_once_per_epoch(
    image_root: Path, tmp_path: Path
) -> None:
    first = write_tars(image_root, tmp_path / "a", samples_per_shard=10)
    again = write_tars(image_root, tmp_path / "b", samples_per_shard=10)
    assert [p.name for p in first] == [f"train-{k:06d}.tar" for k in range(5)]
    # the same folder and seed: the same bytes
    assert [p.read_bytes() for p in first] == [p.read_bytes() for p in again]
    with tarfile.open(first[0]) as tar:
        names = tar.getnames()
    assert len(names) == 20 and names[0].endswith(".jpg") and names[1].endswith(".cls")
    _files, found = list_images(image_root)
    labels = Counter(found)
    pattern = str(tmp_path / "a" / "train-{000000..000004}.tar")
    source = functools.partial(T.image_tars, urls=pattern)
    with Loader(source, T.decode_step, batch_size=4, num_workers=2, copy=True) as loader:
        assert len(loader) == 12  # 48 images, 24 per worker, 6 batches each
        for _epoch in range(2):
            batches = list(loader)
            assert Counter(label for b in batches for label in real(b, "label")) == labels
            assert {b["image"].shape for b in batches} == {(4, 8, 8, 3)}
    # each shard's index is written beside it (DALI's format), and the shards' summary
    kept = sorted(p.name for p in (tmp_path / "a").iterdir() if p.suffix != ".tar")
    assert kept == ["loader-summary.json"] + [f"train-{k:06d}.idx" for k in range(5)]


@pytest.mark.parametrize("window", [None, 2])
def test_resume_on_the_same_and_another_layout_is_exact(tmp_path: Path, window: int | None) -> None:
    T.write_id_tars(tmp_path, TOTAL, 7)
    urls = [str(p) for p in sorted(tmp_path.glob("*.tar"))]
    with loader_over(urls, shuffle_window=window) as loader:
        epochs = [[real(b, "id") for b in loader] for _ in range(2)]
        for batches in epochs:
            assert sorted(i for ids in batches for i in ids) == list(range(TOTAL))
        assert epochs[0] != epochs[1]  # a new order every epoch
    with loader_over(urls, shuffle_window=window) as loader:
        iterator = iter(loader)
        taken = [real(next(iterator), "id") for _ in range(3)]
        state = json.loads(json.dumps(loader.state_dict()))
    assert state["sampling"]["fingerprint"].startswith("tars:")
    with loader_over(urls, shuffle_window=window) as loader:  # the same layout: the same stream
        loader.load_state_dict(state)
        assert taken + [real(b, "id") for b in loader] == epochs[0]
        assert [real(b, "id") for b in loader] == epochs[1]
    with loader_over(urls, workers=3, shuffle_window=window) as loader:  # another: once each
        loader.load_state_dict(state)
        rest = [i for batch in loader for i in real(batch, "id")]
    assert sorted([i for ids in taken for i in ids] + rest) == list(range(TOTAL))


def test_a_state_over_other_shards_is_refused(tmp_path: Path) -> None:
    T.write_id_tars(tmp_path / "a", TOTAL, 7)
    T.write_id_tars(tmp_path / "b", TOTAL, 7, prefix="other")
    with loader_over(str(tmp_path / "a" / "train-{000..004}.tar")) as loader:
        next(iter(loader))
        state = loader.state_dict()
    with loader_over(str(tmp_path / "b" / "other-{000..004}.tar")) as loader:
        with pytest.raises(ValueError, match="tars:"):
            loader.load_state_dict(state)


def test_a_state_over_a_shard_set_with_a_shard_missing_names_it(tmp_path: Path) -> None:
    """The old refusal said only that the sizes differ (600 samples, 570); now it names the
    shard."""
    T.write_id_tars(tmp_path, TOTAL, 7)
    with loader_over(str(tmp_path / "train-{000..004}.tar")) as loader:
        next(iter(loader))
        state = loader.state_dict()
    urls = [str(tmp_path / f"train-{k:03d}.tar") for k in (0, 1, 3, 4)]
    with loader_over(urls) as loader:
        with pytest.raises(ValueError, match=r"\(shards missing here: train-002\.tar\)"):
            loader.load_state_dict(state)
        with pytest.raises(
            ValueError, match=r"\(shards missing here: train-002.*strict=False does not lift"
        ):
            loader.load_state_dict(state, strict=False)


def test_a_state_over_shards_rewritten_with_the_same_names_and_keys_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A re-export: the same shard names, the same sample keys and counts, other bytes (each
    sample of the first shard gains a 16 KiB member): the fingerprint sees the shards' sizes."""
    import io
    import tarfile

    T.write_id_tars(tmp_path / "a", TOTAL, 7)
    T.write_id_tars(tmp_path / "b", TOTAL, 7)
    first = tmp_path / "b" / "train-000.tar"
    with tarfile.open(first) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]  # type: ignore[union-attr]
    with tarfile.open(first, "w") as tar:
        for member, data in members:
            tar.addfile(member, io.BytesIO(data))
            if member.name.endswith(".id"):
                extra = tarfile.TarInfo(member.name[: -len(".id")] + ".txt")
                extra.size = 16384
                tar.addfile(extra, io.BytesIO(b"x" * extra.size))
    with loader_over(str(tmp_path / "a" / "train-{000..004}.tar")) as loader:
        next(iter(loader))
        state = loader.state_dict()
    with loader_over(str(tmp_path / "b" / "train-{000..004}.tar"), on_error="skip") as loader:
        with pytest.raises(ValueError, match=r"tars:.*\(shards changed: train-000\.tar \(size"):
            loader.load_state_dict(state)
        with caplog.at_level(logging.WARNING, logger="loader"):
            loader.load_state_dict(state, strict=False)  # a warning instead
        assert any("tars:" in r.getMessage() for r in caplog.records), caplog.text


def test_a_sample_without_a_member_is_named_and_can_be_skipped(tmp_path: Path) -> None:
    T.write_id_tars(tmp_path, TOTAL, 7, skip_cls=frozenset({9}))
    urls = str(tmp_path / "train-{000..004}.tar")
    shard = tmp_path / "train-001.tar"
    with loader_over(urls) as loader:
        with pytest.raises(ValueError, match=rf"{shard}: sample 'group1/s00009' has no \.cls"):
            for _ in loader:
                pass
    with loader_over(urls, on_error="skip") as loader:
        seen, names = [], []
        for batch in loader:
            seen += real(batch, "id")
            names += list(batch.info.skipped_names)
    assert names == [f"{shard}:group1/s00009"]
    assert sorted(set(seen)) == sorted(set(range(TOTAL)) - {9})


def _truncated(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2 + 100])


def _renamed_member(path: Path) -> None:
    with tarfile.open(path, "a") as tar:
        info = tarfile.TarInfo("README")
        tar.addfile(info, None)


@pytest.mark.parametrize(
    ("spoil", "error", "message"),
    [
        (lambda p: p.unlink(), FileNotFoundError, "train-002.tar"),
        (_truncated, ValueError, r"train-002\.tar is not a whole tar file"),
        (_renamed_member, ValueError, r"train-002\.tar: member 'README' .* has no extension"),
        (
            lambda p: p.write_bytes(b"not a tar" * 100),
            ValueError,
            r"train-002\.tar is not a tar file",
        ),
    ],
    ids=["missing", "truncated", "unexpected-name", "not-a-tar"],
)
def test_a_bad_shard_fails_before_the_first_batch_naming_it(
    tmp_path: Path, spoil: Any, error: type[Exception], message: str
) -> None:
    T.write_id_tars(tmp_path, TOTAL, 7)
    spoil(tmp_path / "train-002.tar")
    with pytest.raises(error, match=message):
        loader_over(str(tmp_path / "train-{000..004}.tar"))


def test_a_damaged_shard_is_left_out_under_skip_and_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A truncated shard fails the start (above), but under on_error="skip" the job starts: the
    shard's whole samples before the damage are read, the rest is left out, a warning names
    it, every rank still has as many steps, the node scans it once, and nothing vouches for the
    shard (no .idx, no summary entry): once rewritten, it is read whole."""
    import warnings

    caplog.set_level(logging.INFO, logger="loader")  # (the workers' INFO lines, relayed)
    T.write_id_tars(tmp_path, TOTAL, 7)
    whole = (tmp_path / "train-002.tar").read_bytes()
    _truncated(tmp_path / "train-002.tar")
    urls = str(tmp_path / "train-{000..004}.tar")
    seen: list[int] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        loaders = [
            loader_over(urls, workers=2, on_error="skip", rank=r, world_size=2) for r in range(2)
        ]
    try:
        assert len(loaders[0]) == len(loaders[1])
        for loader in loaders:
            seen += [i for batch in loader for i in real(batch, "id")]
        scans = [r for r in caplog.records if re.search(r"indexed \S*train-002\.tar", r.message)]
        assert len(scans) == 1, [r.message for r in scans]  # (4 workers; the others read its copy)
        left_out = loaders[1].stats().left_out  # (every rank's workers tell their trainer)
        assert len(left_out) == 1 and "train-002.tar" in left_out[0], left_out
        assert "samples are read" in left_out[0]
    finally:
        for loader in loaders:
            loader.close()
    said = [str(w.message) for w in caught if "on_error='skip'" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]  # (the job's: rank 0's worker 0)
    kept = sorted(i for i in seen if 14 <= i < 21)
    assert 0 < len(kept) < 7 and kept == list(range(14, 14 + len(kept))), kept
    assert said[0].count("train-002.tar") == 1 and f"first {len(kept)} samples" in said[0]
    others = [i for i in range(TOTAL) if not 14 <= i < 21]
    assert sorted(i for i in seen if not 14 <= i < 21) == others  # exactly once
    assert not (tmp_path / "train-002.idx").exists()
    storage = storage_for(str(tmp_path))  # (the job's summary: in this node's cache)
    summary = json.loads(cached_summary_path(storage, str(tmp_path)).read_text())
    assert "train-002.tar" not in [row[0] for row in summary["shards"]]
    (tmp_path / "train-002.tar").write_bytes(whole)  # rewritten: read whole, no warning
    with loader_over(urls, on_error="skip") as loader:
        assert sorted(i for batch in loader for i in real(batch, "id")) == list(range(TOTAL))


def labelled(loader: Loader) -> list[int]:
    """The ids of an epoch, each checked to come with its own label (``id % 3``); none
    skipped."""
    ids = []
    for batch in loader:
        assert not batch.info.skipped_names, batch.info.skipped_names
        for i, cls in zip(real(batch, "id"), real(batch, "cls"), strict=True):
            assert cls == i % 3, f"sample {i} came with another's label ({cls})"
            ids.append(i)
    return ids


@pytest.mark.parametrize("lie", ["overlap", "size"])
def test_an_idx_that_lies_about_its_tar_is_not_trusted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, lie: str
) -> None:
    """Beside a good tar, an .idx whose second sample's members point at the first one's bytes
    (overlap), or that gives a member one byte more than it has (size), its last line true:
    the start's checks pass (the tar's size, its last header). The overlap is refused when the
    .idx is read; the size when the member's own header, read with its bytes, disagrees. Either
    way every sample comes once with its own label, and a warning names the .idx and the
    command that mends it (reading writes nothing beside the shards). (Before, the overlap gave
    sample 4 twice and never 5; the size gave a label of "2\\0".)"""
    caplog.set_level(logging.WARNING, logger="loader")
    paths = T.write_id_tars(tmp_path, 8, 4)
    T.index_beside(paths)  # (and the summary: the shard's .idx is read when the shard is)
    idx = paths[1].with_suffix(".idx")
    true = idx.read_bytes()
    T.lie_in_idx(idx, lie)
    with loader_over(str(tmp_path / "train-{000..001}.tar"), workers=1) as loader:
        ids = labelled(loader)
    assert sorted(ids) == list(range(8))
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any(f"--force mends {idx}" in message for message in warned), warned
    assert idx.read_bytes() != true  # (left as it was)


def test_a_link_member_under_skip_leaves_out_only_what_is_from_it_on(tmp_path: Path) -> None:
    """A shard whose samples 0-3 are whole and whose sample 4 starts with a symbolic link: under
    on_error="skip" samples 0-3 are read (before, sample 3 was left out too, and named nowhere:
    "its first 3 samples are read"), and the warning and loader.stats().left_out say what is
    left out: sample 4 on. A link inside a sample leaves that sample out (it has a member
    missing), and only it."""
    import warnings

    from workers.sources.tars._index import scan_whole_samples

    paths = T.write_id_tars(tmp_path, 16, 8)
    T.with_link_member(paths[1], 4)  # train-001: ids 8-15; its sample 4 is id 12
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        urls = str(tmp_path / "train-{000..001}.tar")
        with loader_over(urls, workers=1, on_error="skip") as loader:
            ids = labelled(loader)
            left_out = loader.stats().left_out
    assert sorted(ids) == list(range(12))
    said = [str(w.message) for w in caught if "on_error='skip'" in str(w.message)]
    assert len(said) == 1 and len(left_out) == 1, (said, left_out)
    for line in (said[0], left_out[0]):
        assert "train-001.tar: member 'group0/s00012.id'" in line, line
        assert "first 4 samples are read" in line, line
        assert "the rest of it, from sample 'group0/s00012' at byte" in line, line
    # the link is a sample's second member: that sample is left out, the ones before it read
    inside = T.write_id_tars(tmp_path / "inside", 8, 8)[0]
    T.with_link_member(inside, 4, member=1)  # (group0/s00004.cls)
    with open(inside, "rb") as stream:
        index, damage = scan_whole_samples(str(inside), stream, seekable=True)
    assert "'group0/s00004.cls'" in str(damage) and "not a regular file" in str(damage)
    assert index.samples == 4 and index.left_from.startswith("sample 'group0/s00004' at byte")


def test_a_summary_that_lies_about_a_shard_is_named_with_the_command_that_mends_it(
    tmp_path: Path,
) -> None:
    """A summary whose entry of an unchanged shard says 5 samples where the shard (and its .idx)
    holds 4: the error names the summary, what it says and what the shard holds, and the
    command that rewrites it (before: "the shard changed while the job runs", which it did
    not). Run, that command mends it."""
    import shlex

    from loader import tars
    from workers.sources.storage import StorageFailure

    paths = T.write_id_tars(tmp_path, 8, 4)
    T.index_beside(paths, samples={"train-001.tar": 5})
    urls = str(tmp_path / "train-{000..001}.tar")
    with pytest.raises(StorageFailure) as raised:
        with loader_over(urls, workers=1) as loader:
            for _batch in loader:
                pass
    message = str(raised.value)
    summary, shard = tmp_path / "loader-summary.json", tmp_path / "train-001.tar"
    assert f"the summary {summary} is wrong about {shard}: it says the shard holds 5 samples" in (
        message
    ), message
    assert "the shard holds 4 samples" in message and "changed while" not in message, message
    command = re.search(r"Run python -m loader\.tars (index '(\S+)' --force) ", message)
    assert command is not None and command.group(2) == str(shard), message
    assert tars.main([*shlex.split(command.group(1)), "--workers", "1"]) == 0
    with loader_over(urls, workers=1) as loader:
        assert sorted(labelled(loader)) == list(range(8))


def test_window_orders_read_a_few_shards_at_a_time(tmp_path: Path) -> None:
    """With a window of 1, a worker's batches come from one shard at a time."""
    T.write_id_tars(tmp_path, 64, 8)
    urls = str(tmp_path / "train-{000..007}.tar")
    with loader_over(urls, workers=2, shuffle_window=1) as loader:
        per_worker: dict[int, list[int]] = {0: [], 1: []}
        for batch in loader:
            per_worker[batch.info.worker] += real(batch, "id")
    for ids in per_worker.values():
        shards = [i // 8 for i in ids]
        changes = sum(1 for a, b in itertools.pairwise(shards) if a != b)
        assert len(set(shards)) == 4 and changes == 3  # 4 whole shards, one after another


def test_a_worker_killed_mid_shard_is_replaced_and_the_epoch_stays_exact(tmp_path: Path) -> None:
    import os
    import signal

    # 200 samples: worker 1 has 25 batches, far more than its slots hold, so it cannot have
    # made them all before it is killed (a worker whose batches were all made needs no heir)
    total = 200
    T.write_id_tars(tmp_path, total, 40)
    urls = str(tmp_path / "train-{000..004}.tar")
    with loader_over(urls, shuffle_window=2, max_restarts=1) as loader:
        iterator = iter(loader)
        seen = real(next(iterator), "id") + real(next(iterator), "id")
        os.kill(loader.worker_pids()[1], signal.SIGKILL)
        seen += [i for batch in iterator for i in real(batch, "id")]
        assert loader.stats().restarts == 1
    assert sorted(seen) == list(range(total))


def test_an_unindexed_start_longer_than_startup_timeout_reaches_its_first_batch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Without an index the workers scan every shard before their first batch. On a slow store
    (``throttled://``: one object at a time, 0.15 s each) that takes several times
    ``startup_timeout``, which is not spent on it: the workers tell the trainer how far they
    are (``wire.Starting``), the lead worker logs it (counts, seconds, the index command), and
    the job reaches its first batch."""
    caplog.set_level(logging.INFO, logger="loader")  # (the workers' INFO lines, relayed)
    T.write_id_tars(tmp_path, 96, 2)  # 48 shards: about 10 s of scanning for each worker
    urls = f"throttled://{tmp_path}/train-{{000..047}}.tar"
    with loader_over(
        urls, storage_options={"delay": 0.15}, startup_timeout=4, start_method="forkserver"
    ) as loader:
        assert len(loader) == 24  # (every shard's sample count is known before the first batch)
        first = next(iter(loader))
        assert len(real(first, "id")) == 4
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("worker 0: ")]
    command = f"python -m loader.tars index '{urls}'"
    assert any("48 of 48 tar shards have no index" in m and command in m for m in said), said
    progress = [m for m in said if "before the first batch: " in m and " ready in " in m]
    assert progress and command in progress[0], said
    assert re.search(
        r"indexing 48 tar shards \(48 without an index: scanned\), before the", progress[0]
    )
    done = [m for m in said if "shards had no index: the workers indexed them" in m]
    seconds = re.search(r"indexed them \(([0-9.]+) s", done[0]) if done else None
    assert seconds is not None and float(seconds.group(1)) > 4, said  # beyond startup_timeout


def test_a_worker_silent_for_startup_timeout_names_what_it_was_doing(tmp_path: Path) -> None:
    """A store that never answers for one shard: the worker scanning it (and the one waiting
    for its lock) fall silent, and after ``startup_timeout`` of silence the StartupError says
    what the worker was doing, how far it was, and where it is stuck (its stack)."""
    T.write_id_tars(tmp_path, 40, 2)
    urls = f"throttled://{tmp_path}/train-{{000..019}}.tar"
    options = {"delay": 0.05, "hang": "train-012.tar"}
    with pytest.raises(StartupError) as caught:
        loader_over(urls, storage_options=options, startup_timeout=2, start_method="forkserver")
    text = str(caught.value)
    assert re.search(
        r"^worker \d .* did not start: it sent nothing for 2 s \(startup_timeout\)", text
    ), text
    assert re.search(
        r"it was last indexing 20 tar shards \(20 without an index: scanned\)(, waiting for "
        r"\S+/train-012\.tar, which another process indexes)?: \d+ of 20 done, \d+ s",
        text,
    ), text
    assert "--- worker stack (faulthandler) ---" in text, text


@pytest.mark.parametrize("spoil", ["garbage", "another shard's"])
def test_an_index_the_summary_keeps_that_does_not_fit_its_shard_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, spoil: str
) -> None:
    """The index command keeps these small shards' indexes in the summary; one of them spoilt
    there (text that is no index, or another shard's index, which fits its size): workers that
    read part of that shard do not use it (one of them makes the shard's index from its bytes;
    the garbage is named) and every sample comes once with its own id."""
    import os
    import subprocess
    import sys

    from workers.sources.storage import CACHE_DIR_ENV
    from workers.sources.tars._summary import SUMMARY

    paths = T.write_id_tars(tmp_path / "data", TOTAL, 7)
    pattern = str(tmp_path / "data" / "train-{000..004}.tar")
    env = {**os.environ, CACHE_DIR_ENV: str(tmp_path / "indexing-node")}
    done = subprocess.run(
        [sys.executable, "-m", "loader.tars", "index", pattern],
        capture_output=True,
        text=True,
        env=env,
    )
    assert done.returncode == 0 and "5 small shards' indexes" in done.stdout, done.stdout
    assert not list((tmp_path / "data").glob("*.idx"))
    summary = tmp_path / "data" / SUMMARY
    document = json.loads(summary.read_text())
    names = [path.name for path in paths]
    bad = document["indexes"][names[0]] if spoil != "garbage" else "not an index\n"
    document["indexes"][names[1]] = bad
    summary.write_text(json.dumps(document))
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "another-node"))
    caplog.set_level(logging.INFO)
    with loader_over(pattern, workers=3) as loader:  # (3 parts: shard 1 is cut)
        seen = sorted(i for batch in loader for i in real(batch, "id"))
    assert seen == list(range(TOTAL))
    told = "\n".join(record.getMessage() for record in caplog.records)
    # (the shard indexed from its bytes; the spoilt index never used, so never found out)
    assert re.search(r"indexed \S*train-001\.tar: 7 samples", told), told
    assert "does not describe" not in told, told
    if spoil == "garbage":
        assert "ignored the index the summary keeps" in told, told
