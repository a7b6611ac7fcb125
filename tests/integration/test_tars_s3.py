"""sharded_tars over an object store: a real S3-protocol server (moto's, on 127.0.0.1), real s3fs
in the workers, real boto3 in the test."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loader import Loader
from tests import tar_pipelines as T
from workers.sources.storage import StorageFailure

boto3 = pytest.importorskip("boto3")
pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

pytestmark = pytest.mark.timeout(300)

TOTAL = 64  # 16 shards of 4 samples
BUCKET = "shards"
PATTERN = f"s3://{BUCKET}/train-{{000..015}}.tar"


class Store:
    """A bucket on a running server, and what a source needs to reach it."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.options = {
            "key": "testing",
            "secret": "testing",
            "endpoint_url": endpoint,
            "client_kwargs": {"region_name": "us-east-1"},
        }

    def client(self) -> Any:
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )

    def upload(self, paths: list[Path]) -> None:
        client = self.client()
        try:
            client.create_bucket(Bucket=BUCKET)
            for path in paths:
                client.upload_file(str(path), BUCKET, path.name)
        finally:
            client.close()

    def require_credentials(self, required: bool) -> None:
        """Make the server check every request's signature against its IAM users (there are
        none: every key is wrong), or stop checking."""
        import urllib.request

        body = b"0" if required else b"inf"
        request = urllib.request.Request(
            f"{self.endpoint}/moto-api/reset-auth",
            body,
            headers={"Content-Type": "text/plain"},  # (a form's body would be parsed away)
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200

    def delete(self, names: list[str]) -> None:
        client = self.client()
        try:
            for name in names:
                client.delete_object(Bucket=BUCKET, Key=name)
        finally:
            client.close()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        made = Store(f"http://{host}:{port}")
        made.upload(T.write_id_tars(tmp_path / "tars", TOTAL, 4))
        try:
            yield made
        finally:
            made.require_credentials(False)  # (the setting is the test process's, not the server's)
    finally:
        server.stop()
        if server._server is not None:  # (stop() leaves the listening socket open)
            server._server.server_close()


def make(store: Store, workers: int, rank: int, world: int, **kw: Any) -> Loader:
    return id_loader(PATTERN, store.options, workers, rank, world, **kw)


def id_loader(
    urls: str, options: dict[str, Any], workers: int, rank: int, world: int, **kw: Any
) -> Loader:
    """A loader of ``T.id_tars`` over ``urls`` (batches of 4, ``rank`` of ``world``)."""
    source = functools.partial(T.id_tars, urls=urls, storage_options=options, **kw)
    return Loader(
        source,
        T.cls_id_step,
        batch_size=4,
        num_workers=workers,
        rank=rank,
        world_size=world,
        copy=True,
    )


def ids(batch: Any) -> list[int]:
    values = [int(v) for v in np.asarray(batch["id"]).ravel()]
    return values[: len(values) - batch.info.padded]


def test_two_ranks_of_two_workers_read_every_sample_once_and_resume_on_one_rank_of_three(
    store: Store,
) -> None:
    taken: list[int] = []
    epoch: list[int] = []
    states = []
    for rank in range(2):
        with make(store, 2, rank, 2) as loader:
            assert len(loader) == 8  # 64 samples, 16 per shard, 4 batches, 2 workers
            iterator = iter(loader)
            got = [i for _ in range(3) for i in ids(next(iterator))]
            states.append(json.loads(json.dumps(loader.state_dict())))
            taken += got
            epoch += got + [i for batch in iterator for i in ids(batch)]
    assert sorted(epoch) == list(range(TOTAL))
    state = dict(states[0])
    state["received"] = [
        a if a is not None else b
        for a, b in zip(states[0]["received"], states[1]["received"], strict=True)
    ]
    with make(store, 3, 0, 1) as loader:
        loader.load_state_dict(state)
        rest = [i for batch in loader for i in ids(batch)]
        following = [i for batch in loader for i in ids(batch)]
    assert sorted(taken + rest) == list(range(TOTAL))
    assert sorted(set(following)) == list(range(TOTAL))


def test_a_shard_deleted_mid_run_is_a_clear_error_naming_it(store: Store) -> None:
    with make(store, 1, 0, 1, shuffle_window=1, ahead=0) as loader:
        iterator = iter(loader)
        first = ids(next(iterator))
        shard = first[0] // 4  # the shard being read; delete every other one
        gone = [f"train-{k:03d}.tar" for k in range(16) if k != shard]
        store.delete(gone)
        with pytest.raises(StorageFailure) as raised:
            for _ in iterator:
                pass
    assert re.match(
        rf"s3://{BUCKET}/train-0\d\d\.tar does not exist \(reading bytes \d+-\d+\)"
        # (where an earlier test left a summary in the bucket: it names the shard)
        rf"(: removed since the summary s3://{BUCKET}/loader-summary\.json .*)? \[worker 0",
        str(raised.value),
    ), str(raised.value)


def test_a_missing_shard_wrong_credentials_or_an_unreachable_endpoint_fail_at_start(
    store: Store,
) -> None:
    # (no summary: moto's buckets outlive a test, and a summary an earlier test wrote would
    # name the shard, which is then found missing when it is read, not at the start)
    store.delete(["train-007.tar", "loader-summary.json"])
    with pytest.raises(FileNotFoundError, match=rf"s3://{BUCKET}/train-007\.tar"):
        make(store, 1, 0, 1)
    store.require_credentials(True)
    with pytest.raises(PermissionError, match=rf"s3://{BUCKET}/.* denied .*check the credentials"):
        make(store, 1, 0, 1)
    store.require_credentials(False)
    # nothing listens on port 9: botocore tries (5 times, by default); the source does not add
    # its own retries to those, and names the endpoint
    unreachable = dict(store.options, endpoint_url="http://127.0.0.1:9")
    source = functools.partial(T.id_tars, urls=PATTERN, storage_options=unreachable)
    started = time.monotonic()
    with pytest.raises(
        ConnectionError,
        match=rf"cannot connect to the store at http://127\.0\.0\.1:9 \((listing|reading) "
        rf"s3://{BUCKET}/(loader-summary\.json)?\)",
    ):
        Loader(source, T.cls_id_step, batch_size=4, num_workers=1)
    assert time.monotonic() - started < 30  # (botocore's own backoff: ~10 s; ours added 55)


# -- what a start costs: counted by a proxy in front of the server ------------------------------


class Counted:
    """A server with a bucket of its own (so that no test finds another's indexes in the
    session's cache), and a proxy in front of it that counts requests and bytes."""

    def __init__(self) -> None:
        from bench._s3 import CountingProxy, S3Server

        self.server = S3Server(threaded=True)
        self.proxy = CountingProxy(self.server.endpoint)
        self.bucket = f"shards-{uuid.uuid4().hex[:12]}"
        self.server.bucket(self.bucket)

    def upload(self, paths: list[Path]) -> None:
        client = self.server.client()
        try:
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(lambda p: client.upload_file(str(p), self.bucket, p.name), paths))
        finally:
            client.close()

    def url(self, pattern: str) -> str:
        return f"s3://{self.bucket}/{pattern}"

    def index(self, pattern: str) -> str:
        """``python -m loader.tars index`` straight to the server (not counted)."""
        options = json.dumps(self.server.options())
        command = ["index", self.url(pattern), "--storage-options", options, "--workers", "2"]
        done = subprocess.run(
            [sys.executable, "-m", "loader.tars", *command], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    def loader(
        self, pattern: str, workers: int = 2, rank: int = 0, world_size: int = 1, **kw: Any
    ) -> Loader:
        """A loader reading through the proxy."""
        options = self.server.options(self.proxy.endpoint)
        return id_loader(self.url(pattern), options, workers, rank, world_size, **kw)

    def tar_bytes(self) -> int:
        """Bytes of shards served so far."""
        return sum(s.bytes for s in self.proxy.records() if s.name.endswith(".tar"))

    def close(self) -> None:
        self.proxy.close()
        self.server.close()


@pytest.fixture
def counted() -> Iterator[Counted]:
    made = Counted()
    try:
        yield made
    finally:
        made.close()


def _size(paths: list[Path]) -> int:
    return sum(path.stat().st_size for path in paths)


def test_webdataset_shards_indexed_by_dalis_wds2idx_are_read_once_per_epoch(
    counted: Counted, tmp_path: Path
) -> None:
    """Shards written by ``webdataset.TarWriter``, indexed by DALI's ``wds2idx``, no summary:
    nothing is scanned, and an epoch reads each shard's bytes once."""
    wds = pytest.importorskip("webdataset")
    tool = shutil.which("wds2idx") or str(Path(sys.executable).with_name("wds2idx"))
    if not Path(tool).exists():
        pytest.skip("DALI's wds2idx is not installed")
    paths, indexes = [], []
    for number in range(16):
        path = tmp_path / f"wds-{number:03d}.tar"
        with wds.TarWriter(str(path)) as writer:
            for sample in range(number * 8, number * 8 + 8):
                payload = bytes([sample % 256]) * 3000
                writer.write(
                    {
                        "__key__": f"s{sample:05d}",
                        "bin": payload,
                        "cls": str(sample % 3),
                        "id": str(sample),
                    }
                )
        subprocess.run(
            [tool, str(path), str(path.with_suffix(".idx"))], check=True, capture_output=True
        )
        paths.append(path)
        indexes.append(path.with_suffix(".idx"))
    counted.upload(paths + indexes)
    with counted.loader("wds-{000..015}.tar") as loader:
        assert len(loader) == 32  # 128 samples in batches of 4
        seen = [i for batch in loader for i in ids(batch)]
    assert sorted(seen) == list(range(128))
    served = counted.proxy.records()
    tars = [s for s in served if s.name.endswith(".tar")]
    assert not [s for s in tars if s.method == "HEAD"]  # no shard was opened to be scanned
    # (512 bytes: a check of a shard's last header.) The epoch's reads come first, one per
    # shard; after them, the workers fetch the first shards of the next epoch ahead of it.
    reads = [s for s in tars if s.bytes > 512]
    assert sorted(s.name for s in reads[:16]) == [path.name for path in paths]
    assert sum(s.bytes for s in reads[:16]) <= _size(paths)
    # the first worker kept the summary in this node's cache (the next start here reads no index
    # before reading a shard): reading writes nothing into the bucket
    assert not [s.name for s in served if s.method == "PUT"]


@pytest.mark.parametrize("indexed_by", ["loader.tars index", "wds2idx only"])
def test_a_fresh_cache_reads_a_fraction_of_the_dataset_before_the_first_batch(
    counted: Counted, tmp_path: Path, indexed_by: str
) -> None:
    """48 shards, 2 workers, a cache that has never seen them: the first batch waits for the
    shards of each worker's first group (4 of 48 each), not for the dataset."""
    from workers.sources.tars._index import scan
    from workers.sources.tars._wds_idx import format_idx

    paths = T.write_payload_tars(tmp_path, 48, 40, 8000)
    counted.upload(paths)
    if indexed_by == "wds2idx only":  # (the same bytes as DALI's tool: see the unit tests)
        made = []
        for path in paths:
            with open(path, "rb") as stream:
                text = format_idx(scan(str(path), stream, seekable=True))
            assert text is not None
            path.with_suffix(".idx").write_bytes(text)
            made.append(path.with_suffix(".idx"))
        counted.upload(made)
    else:
        assert "48 of 48 shards indexed" in counted.index("train-{0000..0047}.tar")
    counted.proxy.reset()
    with counted.loader("train-{0000..0047}.tar") as loader:
        first = next(iter(loader))
        requests, served = counted.proxy.count()
    assert len(ids(first)) == 4
    assert served <= 0.25 * _size(paths), (requests, served, _size(paths))
    if indexed_by == "loader.tars index":
        assert requests <= 40, counted.proxy.records()


def _first_batch(counted: Counted, pattern: str, count: int) -> list[Any]:
    """What a start of 2 workers costs after the index command, up to its first batch."""
    counted.proxy.reset()
    with counted.loader(pattern) as loader:
        assert len(loader) == count  # 4 samples a shard, batches of 4
        next(iter(loader))
        return counted.proxy.records()


def _kinds(served: list[Any]) -> Counter[str]:
    return Counter(
        "LIST" if "list-type" in s.query else f"{s.method} .{s.name.rsplit('.', 1)[-1]}"
        for s in served
    )


def test_requests_before_the_first_batch_do_not_grow_with_the_shards_after_the_index_command(
    tmp_path: Path,
) -> None:
    """64 and 1,024 shards: after the index command a start reads the summary once for the
    node (its 2 workers), no listing, then each worker its first shards (whole, one GET each);
    a shard's identity is checked by the read of its bytes itself (the GET's ETag and size).

    The workers go on while the trainer takes its first batch, so how many shards they have
    read by then is timing: each fills at most its ring's slots (``prefetch`` + 2, one shard a
    batch here), loads one more batch and fetches ``ahead`` (2) shards beyond it. That bound is
    the same at both sizes; a start that read a shard's index, HEAD or listing per shard
    would pass it at 64 shards already."""
    served = {}
    for count in (64, 1024):
        counted = Counted()
        try:
            counted.upload(T.write_payload_tars(tmp_path / str(count), count, 4, 200))
            pattern = f"train-{{0000..{count - 1:04d}}}.tar"
            assert f"{count} of {count} shards indexed" in counted.index(pattern)
            served[count] = _first_batch(counted, pattern, count)
        finally:
            counted.close()
    print({count: (len(records), dict(_kinds(records))) for count, records in served.items()})
    for count, records in served.items():
        kinds = _kinds(records)
        assert not kinds["LIST"], (count, kinds)
        assert kinds["GET .json"] == 1, (count, kinds)  # the summary, once for the node
        assert not kinds["HEAD .tar"], (count, kinds)  # (the reads tell the identities)
    per_worker = (2 + 2) + 1 + 2  # the ring's slots, the batch loading, the shards ahead
    for count, records in served.items():
        tars = [s for s in records if s.name.endswith(".tar")]
        assert len(tars) == len({s.name for s in tars}), (count, tars)  # each shard once
        assert len(tars) <= 2 * per_worker, (count, _kinds(records))


def _replace(counted: Counted, paths: list[Path], change: str) -> None:
    """Replace (or remove) ``paths[3]`` in the bucket."""
    if change == "removed":
        client = counted.server.client()
        try:
            client.delete_object(Bucket=counted.bucket, Key=paths[3].name)
        finally:
            client.close()
        return
    other = paths[3].parent / "other"
    if change == "six samples":  # (its .idx and the summary tell the old 4)
        replaced = T.write_payload_tars(other, 4, 6, 100)[3]
    else:  # a byte of a sample's payload: the same size, members and keys, another ETag
        data = bytearray(paths[3].read_bytes())
        data[520] ^= 0xFF
        replaced = other / paths[3].name
        other.mkdir()
        replaced.write_bytes(bytes(data))
    counted.upload([replaced])


@pytest.mark.parametrize("change", ["other bytes, same size", "six samples", "removed"])
def test_a_shard_replaced_after_indexing_is_named_when_it_is_read(
    counted: Counted, tmp_path: Path, change: str
) -> None:
    """No listing at the start: the summary's entry of a shard replaced (or removed) since the
    index command is believed until the shard is read; the read itself (its ETag and size)
    tells the shard changed, and the error names it and the command that fixes it."""
    paths = T.write_payload_tars(tmp_path, 8, 4, 100)
    counted.upload(paths)
    counted.index("train-{0000..0007}.tar")
    _replace(counted, paths, change)
    counted.proxy.reset()
    with pytest.raises(StorageFailure) as raised:
        with counted.loader("train-{0000..0007}.tar", shuffle_window=2) as loader:
            for _batch in loader:
                pass
    message, shard = str(raised.value), rf"s3://{counted.bucket}/train-0003\.tar"
    summary = rf"s3://{counted.bucket}/loader-summary\.json"
    if change == "removed":
        expected = rf"{shard} does not exist \(reading bytes \d+-\d+\): removed since the "
        expected += rf"summary {summary} that names it was written; take it out of the job's"
    else:
        expected = rf"{shard} changed since it was indexed \((size|ETag).*the summary {summary} "
        expected += rf".* stale for it\. Run python -m loader\.tars index '{shard}'"
    assert re.search(expected, message), message
    assert not [s for s in counted.proxy.records() if "list-type" in s.query]
    if change == "removed":
        return
    # the command named: the shard is read as it is now
    counted.index("train-0003.tar")
    with counted.loader("train-{0000..0007}.tar", shuffle_window=2) as loader:
        seen = sorted(i for batch in loader for i in ids(batch))
    if change == "six samples":
        assert seen == sorted(list(range(12)) + list(range(16, 32)) + list(range(18, 24)))
    else:
        assert seen == list(range(32))


def test_an_epoch_on_two_ranks_of_four_workers_reads_the_dataset_about_once(
    counted: Counted, tmp_path: Path
) -> None:
    """20 shards on 2 ranks x 4 workers (a worker's part: 2.5 shards): each worker reads its
    own piece of each shard it needs, so an epoch serves about the dataset's bytes (before,
    workers sharing a group of shards each fetched all of it: 2.1x)."""
    paths = T.write_payload_tars(tmp_path, 20, 40, 8000)
    counted.upload(paths)
    counted.index("train-{0000..0019}.tar")
    served, seen = 0, []
    for rank in range(2):  # (one rank after the other: the bytes of each one's second epoch)
        with counted.loader("train-{0000..0019}.tar", 4, rank, 2) as loader:
            for _batch in loader:  # epoch 0: the cache's first reads, the next epoch's ahead
                pass
            before = counted.tar_bytes()
            seen += [i for batch in loader for i in ids(batch)]
            served += counted.tar_bytes() - before
    assert sorted(seen) == list(range(800))
    assert served <= 1.25 * _size(paths), served / _size(paths)


def test_a_worker_that_reads_whole_shards_reads_each_with_one_request_and_no_index(
    counted: Counted, tmp_path: Path
) -> None:
    """20 indexed shards of 40 samples, 2 workers: each worker's part of an epoch is 10 whole
    shards, so it reads each shard in one GET and indexes it from those bytes (checked against
    the summary): no ``.idx`` is fetched, one GET per shard and epoch (at each epoch's end a
    worker fetches up to ``ahead`` = 2 of the next epoch's shards: 8 more at most), every
    sample once in each epoch. (Before: a GET of the ``.idx`` first for each shard, 80 in all.)"""
    paths = T.write_payload_tars(tmp_path, 20, 40, 2000)
    counted.upload(paths)
    counted.index("train-{0000..0019}.tar")
    counted.proxy.reset()
    with counted.loader("train-{0000..0019}.tar", 2) as loader:
        for _epoch in range(2):
            assert sorted(i for batch in loader for i in ids(batch)) == list(range(800))
    kinds = _kinds(counted.proxy.records())
    assert kinds["GET .idx"] == 0, kinds
    assert 40 <= kinds["GET .tar"] <= 48, kinds


@pytest.mark.parametrize("idx_files", [False, True])
def test_the_index_command_reads_each_shard_with_one_get_and_no_head(
    counted: Counted, tmp_path: Path, idx_files: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``python -m loader.tars index`` over 12 S3 shards, through the proxy: one listing, then
    per shard one GET of its bytes (whose ETag and size are the identity it is indexed as), and
    the summary: no HEAD (before: a HEAD per shard). Their indexes are small: the summary keeps
    them (no PUT of an ``.idx``; before: one a shard), and workers that read parts of shards
    fetch no ``.idx`` (on another node: nothing in its cache); ``--idx-files`` writes them
    beside the shards, which those workers fetch."""
    counted.upload(T.write_payload_tars(tmp_path, 12, 5, 500))
    options = json.dumps(counted.server.options(counted.proxy.endpoint))
    counted.proxy.reset()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "loader.tars",
            "index",
            counted.url("train-{0000..0011}.tar"),
            *("--storage-options", options, "--workers", "2"),
            *(["--idx-files"] if idx_files else []),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "12 of 12 shards indexed" in done.stdout
    kinds = _kinds(counted.proxy.records())
    expected = {"LIST": 1, "GET .tar": 12, "PUT .json": 1}
    assert kinds == Counter(expected, **({"PUT .idx": 12} if idx_files else {})), kinds
    counted.proxy.reset()
    monkeypatch.setenv("DALI_LOADER_CACHE_DIR", str(tmp_path / "another-node"))
    with counted.loader("train-{0000..0011}.tar", 5) as loader:  # (5 parts cut the shards)
        assert sorted(i for batch in loader for i in ids(batch)) == list(range(60))
    fetched = _kinds(counted.proxy.records())["GET .idx"]
    assert (fetched > 0) if idx_files else (fetched == 0), fetched


def test_a_resume_builds_its_sources_again_from_the_shards_its_workers_opened(
    counted: Counted, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resume's seek builds each worker's source again, at the saved position: from the shards
    that worker opened at its start (the set the job's plan was made from), not by reading the
    summary again, though the node's copy of it is gone by then. The epoch still ends with
    every sample once."""
    monkeypatch.setenv("DALI_LOADER_CACHE_DIR", str(tmp_path / "node-cache"))
    paths = T.write_payload_tars(tmp_path / "shards", 16, 4, 100)
    counted.upload(paths)
    pattern = "train-{0000..0015}.tar"
    assert "16 of 16 shards indexed" in counted.index(pattern)
    with counted.loader(pattern) as loader:
        batches = iter(loader)
        first = [i for _ in range(6) for i in ids(next(batches))]
        state = loader.state_dict()
    counted.proxy.reset()
    with counted.loader(pattern) as loader:  # (constructed: its workers have opened the shards)
        shutil.rmtree(tmp_path / "node-cache")
        loader.load_state_dict(state)
        rest = [i for batch in loader for i in ids(batch)]
    assert sorted(first + rest) == list(range(64))
    kinds = _kinds(counted.proxy.records())
    assert kinds["GET .json"] == 1, kinds  # the start's, for the node; none for the seek


# -- a job's start, as a script: what its worker server has imported ahead ----------------------

STORAGE_SCRIPT = """
import functools, sys
from loader import Loader
from tests import tar_pipelines as T


def source(shard, urls, options, report):
    with open(report, "a") as file:  # (what this worker's server had imported)
        file.write(f"{'s3fs' in sys.modules}\\n")
    return T.id_tars(shard, urls, storage_options=options)


if __name__ == "__main__":
    urls, options, report = sys.argv[1], eval(sys.argv[2]), sys.argv[3]
    made = functools.partial(source, urls=urls, options=options, report=report)
    with Loader(made, T.cls_id_step, batch_size=4, num_workers=2) as loader:
        print(sorted(int(i) for i in next(iter(loader))["id"].ravel()))
"""


def test_the_next_run_of_a_script_finds_the_storage_client_its_last_run_opened_imported(
    counted: Counted, tmp_path: Path
) -> None:
    """A script run as a user runs it (its own main, the worker server started early): its
    workers open s3fs; the next run's server imports s3fs while it warms, so its workers start
    with it; with the cache switched off, nothing is remembered."""
    counted.upload(T.write_payload_tars(tmp_path / "shards", 8, 4, 50))
    script = tmp_path / "train.py"
    script.write_text(STORAGE_SCRIPT)
    root = Path(__file__).resolve().parents[2]

    def run(name: str, analysis: str) -> list[str]:
        report = tmp_path / f"{name}.txt"
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("PYTEST")},
            "PYTHONPATH": str(root),
            "DALI_LOADER_ANALYSIS_CACHE": analysis,
            "DALI_LOADER_CACHE_DIR": str(tmp_path / f"node-{name}"),
        }
        options = repr(counted.server.options(counted.proxy.endpoint))
        done = subprocess.run(
            [sys.executable, str(script), counted.url("train-{0000..0007}.tar"), options, report],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=240,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return sorted(report.read_text().split())

    analysis = str(tmp_path / "analysis")
    assert run("first", analysis) == ["False", "False"]
    assert run("second", analysis) == ["True", "True"]
    assert run("off", "0") == ["False", "False"]


def test_a_worker_sets_its_store_client_up_ahead_and_without_a_request(counted: Counted) -> None:
    """In a loader's worker (its pool's token set), s3fs's client is set up on a thread of its
    own as the storage is made, so that the first read does not wait for it; that sends nothing
    to the store. Elsewhere (a trainer, the index command) no thread is started. (In a process of
    its own, as a worker is: fsspec's event loop then stays out of this one.)"""
    code = textwrap.dedent(
        """
        import sys, threading, time
        from workers.sources.plan._control import STARTED_TOGETHER
        from workers.sources.storage import storage_for

        url, options = sys.argv[1], eval(sys.argv[2])
        elsewhere = storage_for(url, options, retries=7)
        started = any(t.name == "dali-loader-connect" for t in threading.enumerate())
        token = STARTED_TOGETHER.set("pool-token")
        try:
            worker = storage_for(url, {**options, "skip_instance_cache": True}, retries=8)
        finally:
            STARTED_TOGETHER.reset(token)
        deadline = time.monotonic() + 30
        while worker.fs._s3 is None and time.monotonic() < deadline:
            time.sleep(0.01)
        print(started, worker.fs._s3 is not None, elsewhere.fs._s3 is not None)
        """
    )
    options = repr(counted.server.options(counted.proxy.endpoint))
    counted.proxy.reset()
    done = subprocess.run(
        [sys.executable, "-c", code, counted.url("a.tar"), options],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True", "False"]
    assert counted.proxy.records() == []


def test_the_index_command_names_a_truncated_small_shard_and_indexes_the_others(
    counted: Counted, tmp_path: Path
) -> None:
    """Six small S3 shards, one cut short: the command (which reads small shards on the store
    client's event loop) exits with 1 naming that shard, and keeps the five others' indexes in
    the summary, which a second run finds up to date (then only the cut shard is read again)."""
    from workers.sources.tars._summary import decode

    paths = T.write_payload_tars(tmp_path, 6, 5, 500)
    data = paths[3].read_bytes()
    paths[3].write_bytes(data[: len(data) // 2 + 100])
    counted.upload(paths)
    options = json.dumps(counted.server.options(counted.proxy.endpoint))
    command = [
        sys.executable,
        *("-m", "loader.tars", "index", counted.url("train-{0000..0005}.tar")),
        *("--storage-options", options),
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "train-0003.tar" in done.stdout + done.stderr
    assert "5 of 6 shards indexed" in done.stdout, done.stdout
    client = counted.server.client()
    try:
        body = client.get_object(Bucket=counted.bucket, Key="loader-summary.json")["Body"].read()
    finally:
        client.close()
    entries = decode(body, "summary")
    assert sorted(entries) == [f"train-{k:04d}.tar" for k in (0, 1, 2, 4, 5)]
    assert all(entry.idx.startswith("v1.2 5\n") for entry in entries.values())
    counted.proxy.reset()
    again = subprocess.run(command, capture_output=True, text=True)
    assert again.returncode == 1 and "5 up to date" in again.stdout, again.stdout
    assert _kinds(counted.proxy.records())["GET .tar"] == 1
