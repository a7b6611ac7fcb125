"""A store that answers HTTP 429 Too Many Requests: a real S3-protocol server (moto's, on
127.0.0.1) behind a proxy that answers the next N GETs of an object (or of the bucket's listing)
with 429 and an S3 error body; real s3fs in the workers. The client's own retries are turned off
(``total_max_attempts: 1``) so that every 429 reaches the loader's: each is then one request the
proxy counts and one retry the worker logs."""

from __future__ import annotations

import functools
import logging
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("datasets")
pytest.importorskip("boto3")
pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from loader import Loader, sharded_parquet
from tests import parquet_pipelines as P
from tests import tar_pipelines as T
from tests.local_stores import ThrottlingProxy
from workers.sources.storage import RETRIES, StorageFailure

pytestmark = pytest.mark.timeout(300)

SIZES = (60, 40)  # rows per Parquet file, in row groups of 20
TARS = 16  # samples, 4 a shard


class Throttled:
    """A bucket of two Parquet files and four tar shards, behind a :class:`ThrottlingProxy`."""

    def __init__(self, tmp_path: Path) -> None:
        from bench._s3 import S3Server

        self.server = S3Server(threaded=True)
        self.proxy = ThrottlingProxy(self.server.endpoint)
        self.bucket = f"throttled-{uuid.uuid4().hex[:12]}"
        files = P.write_parquet(tmp_path / "parquet", SIZES, 20)
        files += T.write_id_tars(tmp_path / "tars", TARS, 4)
        self.server.bucket(self.bucket, files)
        self.options: dict[str, Any] = {
            **self.server.options(self.proxy.endpoint),
            "config_kwargs": {"retries": {"total_max_attempts": 1}},
        }

    def parquet(self) -> Loader:
        source = functools.partial(
            sharded_parquet,
            urls=f"s3://{self.bucket}/*.parquet",
            batch_size=4,
            columns=("label", "id"),
            storage_options=self.options,
            ahead=0,  # (reads on the worker's main thread, whose logs reach the trainer)
        )
        return Loader(source, P.label_id_step, batch_size=4, num_workers=1, copy=True)

    def tars(self) -> Loader:
        source = functools.partial(
            T.id_tars,
            urls=f"s3://{self.bucket}/train-{{000..003}}.tar",
            ahead=0,
            storage_options=self.options,
        )
        return Loader(source, T.cls_id_step, batch_size=4, num_workers=1, copy=True)

    def close(self) -> None:
        self.proxy.close()
        self.server.close()


@pytest.fixture
def throttled(tmp_path: Path) -> Iterator[Throttled]:
    made = Throttled(tmp_path)
    try:
        yield made
    finally:
        made.close()


def epoch_ids(loader: Loader) -> list[int]:
    with loader:
        return sorted(int(i) for batch in loader for i in np.asarray(batch["id"]).ravel())


def retries_logged(caplog: pytest.LogCaptureFixture, url: str) -> int:
    return sum("trying again" in r.getMessage() and url in r.getMessage() for r in caplog.records)


def test_a_429_on_a_listing_a_footer_and_a_row_group_is_retried_and_logged(
    throttled: Throttled, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    first = "train-00000.parquet"
    throttled.proxy.throttle(throttled.bucket, 2)  # the bucket's listing (the glob)
    throttled.proxy.throttle(first, 3)  # its footer: the first GET of the file
    assert epoch_ids(throttled.parquet()) == list(range(sum(SIZES)))
    refused = throttled.proxy.throttled()
    assert [s.name for s in refused] == [throttled.bucket] * 2 + [first] * 3
    assert all(s.range for s in refused[2:])  # (ranged reads of the footer)
    # the listing's retries (the worker's main thread) and the footer's (read on a pool's
    # thread: its records are held and sent with the worker's next batch) reach the trainer
    assert retries_logged(caplog, f"s3://{throttled.bucket}/*.parquet") == 2
    assert retries_logged(caplog, f"s3://{throttled.bucket}/{first}") == 3
    footer = [r.getMessage() for r in caplog.records if first in r.getMessage()]
    assert all(m.startswith("worker 0: ") for m in footer), footer
    assert any("TooManyRequests" in r.getMessage() for r in caplog.records)

    # the footers are the node's now: a second loader's first GETs of the file read row groups
    second = "train-00001.parquet"
    throttled.proxy.reset()
    throttled.proxy.throttle(second, 2)
    assert epoch_ids(throttled.parquet()) == list(range(sum(SIZES)))
    refused = throttled.proxy.throttled()
    assert [s.name for s in refused] == [second] * 2
    assert all(s.range for s in refused)  # (ranged reads of row groups)


def run_code(code: str, url: str, options: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    """``code`` in a process of its own, given the URL and the storage options."""
    return subprocess.run(
        [sys.executable, "-c", code, url, repr(options)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
        timeout=120,
    )


def test_a_429_on_a_tar_shard_is_retried(throttled: Throttled) -> None:
    throttled.proxy.throttle("train-002.tar", 3)
    assert epoch_ids(throttled.tars()) == list(range(TARS))
    assert [s.name for s in throttled.proxy.throttled()] == ["train-002.tar"] * 3


def test_each_retry_of_a_429_is_logged_with_the_url_and_the_status(throttled: Throttled) -> None:
    """The storage alone, read in a process of its own: each retry logged with the URL, the
    range and the status; a 429 that never stops fails after RETRIES."""
    url = f"s3://{throttled.bucket}/train-001.tar"
    code = textwrap.dedent(
        """
        import logging, sys
        from workers.sources.storage import storage_for

        logging.basicConfig(level=logging.WARNING, format="%(name)s %(message)s")
        url, options = sys.argv[1], eval(sys.argv[2])
        try:
            print(bytes(storage_for(url, options).read(url, 0, 512)[:11]).decode())
        except OSError as error:
            print(f"failed: {error}")
        """
    )

    def read() -> subprocess.CompletedProcess[str]:
        done = run_code(code, url, throttled.options)
        assert done.returncode == 0, done.stderr
        return done

    throttled.proxy.throttle("train-001.tar", 2)
    done = read()
    assert done.stdout.strip() == "group0/s000"  # (its first member's name)
    assert [s.name for s in throttled.proxy.throttled()] == ["train-001.tar"] * 2
    logged = [line for line in done.stderr.splitlines() if "trying again" in line]
    assert len(logged) == 2, done.stderr
    assert all(line.startswith(f"workers {url}: reading bytes 0-512 failed") for line in logged)
    assert all("TooManyRequests" in line for line in logged)

    throttled.proxy.throttle("train-001.tar", 10**6)
    done = read()
    assert done.stdout.startswith(f"failed: {url}: reading bytes 0-512 failed (HTTP 429): ")
    assert "TooManyRequests" in done.stdout
    assert sum("trying again" in line for line in done.stderr.splitlines()) == RETRIES
    assert len(throttled.proxy.throttled()) == 2 + RETRIES + 1


def test_a_429_that_never_stops_is_a_storage_failure_naming_the_url(
    throttled: Throttled,
) -> None:
    assert epoch_ids(throttled.parquet()) == list(range(sum(SIZES)))  # (the node has the footers)
    name = "train-00001.parquet"
    throttled.proxy.reset()
    throttled.proxy.throttle(name, 10**6)
    with pytest.raises(StorageFailure) as raised:
        epoch_ids(throttled.parquet())
    said = str(raised.value)
    assert f"s3://{throttled.bucket}/{name}: reading bytes" in said, said
    assert "TooManyRequests" in said, said
    # the first try and RETRIES more, then no other request for it
    assert [s.name for s in throttled.proxy.throttled()] == [name] * (RETRIES + 1)


READ_EACH = textwrap.dedent(
    """
    import json, logging, sys
    from workers.sources.storage import read_each, storage_for

    logging.basicConfig(level=logging.WARNING, format="%(name)s %(message)s")
    options, reads = eval(sys.argv[1]), json.loads(sys.argv[2])
    storage = storage_for(reads[0][0], options)
    found = {}
    for number, got in read_each(storage, [tuple(r) for r in reads], 3):
        found[number] = (
            [type(got).__name__, str(got)] if isinstance(got, Exception) else got.hex()
        )
    print(json.dumps(found))
    """
)


def test_many_reads_on_the_event_loop_are_retried_each_and_fail_each_by_name(
    throttled: Throttled, tmp_path: Path
) -> None:
    """``read_each`` (the index command's footers, all on s3fs's event loop; in a process of
    its own): every range comes back right; a 429 on one object is retried and logged as a
    thread's read is; a read past an object's end, a missing object and a 429 that never stops
    each end in their own named error, the others unharmed."""
    import json

    written = sorted((tmp_path / "tars").glob("train-*.tar"))
    tars = [f"s3://{throttled.bucket}/{path.name}" for path in written]
    contents = [path.read_bytes() for path in written]
    reads = [[url, 100, len(data) - 7] for url, data in zip(tars, contents, strict=True)]
    reads += [
        [tars[2], len(contents[2]) - 10, len(contents[2]) + 90],  # past its end
        [f"s3://{throttled.bucket}/no-such.tar", 0, 10],
    ]

    def read(asked: list[list[Any]]) -> tuple[dict[int, Any], str]:
        done = subprocess.run(
            [sys.executable, "-c", READ_EACH, repr(throttled.options), json.dumps(asked)],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parents[2],
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        found = json.loads(done.stdout.strip().splitlines()[-1])
        return {int(k): v for k, v in found.items()}, done.stderr

    throttled.proxy.throttle("train-001.tar", 2)
    found, logged = read(reads)
    assert sorted(found) == list(range(len(reads)))
    for k in range(4):
        assert bytes.fromhex(found[k]) == contents[k][100:-7]
    assert found[4][0] == "EOFError" and "truncated or replaced" in found[4][1]
    assert found[5][0] == "FileNotFoundError"
    assert [s.name for s in throttled.proxy.throttled()] == ["train-001.tar"] * 2
    retried = [line for line in logged.splitlines() if "trying again" in line]
    assert len(retried) == 2 and all(tars[1] in line for line in retried), logged

    throttled.proxy.throttle("train-003.tar", 10**6)
    found, _ = read(reads[:4])
    assert [isinstance(found[k], str) for k in range(4)] == [True] * 3 + [False]
    assert found[3][0] == "OSError" and "TooManyRequests" in found[3][1]
    assert found[3][1].startswith(f"{tars[3]}: reading bytes 100-")


def test_a_lasting_503_slow_down_is_asked_retries_times_not_125(throttled: Throttled) -> None:
    """S3's 503 SlowDown, lasting: s3fs tries it 5 times in each of two nested layers; under
    the loader's retries that was 125 requests over minutes (a job that looked hung). Now the
    loader's retries are the ones, and the error says the status."""
    url = f"s3://{throttled.bucket}/train-002.tar"
    code = textwrap.dedent(
        """
        import sys
        from workers.sources.storage import storage_for

        url, options = sys.argv[1], eval(sys.argv[2])
        storage = storage_for(url, options)
        (identity,) = storage.identities([url])
        print("listed", flush=True)
        try:
            storage.read(url, 0, 512, expect=identity)  # (as a worker reads: checked)
        except OSError as error:
            print(f"failed: {error}")
        """
    )
    throttled.proxy.throttle("train-002.tar", 10**6, status=503)
    done = run_code(code, url, throttled.options)
    assert len(throttled.proxy.throttled()) == RETRIES + 1
    assert done.stdout.startswith(f"listed\nfailed: {url}: reading bytes 0-512 failed (HTTP 503)")
    # (no HEAD to ask whether the object changed: a store that kept failing is not a change)
    heads = [s for s in throttled.proxy.records() if s.method == "HEAD"]
    assert not heads, heads
