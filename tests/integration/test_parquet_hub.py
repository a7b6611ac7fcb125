"""sharded_parquet over ``hf://datasets/<repo>@<revision>/<glob>`` URLs: real ``huggingface_hub``
(its fsspec filesystem, ``HfFileSystem``) in the workers, against a local server that answers
the Hub's routes it lists and reads with (``tests.local_stores.LocalHub``: a revision's
information, tree listings, ranged reads from ``resolve``). No request leaves 127.0.0.1."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("datasets")
pytest.importorskip("huggingface_hub")

from loader import Loader, sharded_parquet
from tests import parquet_pipelines as P
from tests.local_stores import LocalHub

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]
SIZES = (60, 40)  # rows per file, in row groups of 20
REPO = "someone/images"
URLS = f"hf://datasets/{REPO}@v1/data/*.parquet"


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[LocalHub]:
    made = LocalHub()
    try:
        files = P.write_parquet(tmp_path / "v1", SIZES, 20)
        made.add(
            REPO,
            "v1",
            {**{f"data/{p.name}": p.read_bytes() for p in files}, "README.md": b"# images\n"},
        )
        # another revision, of other rows: a URL naming v1 never reads it
        (older,) = P.write_parquet(tmp_path / "main", (8,), 8)
        made.add(REPO, "main", {f"data/{older.name}": older.read_bytes()})
        yield made
    finally:
        made.close()


def loader(urls: str, options: dict[str, Any], workers: int = 2) -> Loader:
    source = functools.partial(
        sharded_parquet,
        urls=urls,
        batch_size=4,
        columns=("label", "id"),
        storage_options=options,
    )
    return Loader(source, P.label_id_step, batch_size=4, num_workers=workers, copy=True)


def epoch_ids(made: Loader) -> list[int]:
    with made:
        return sorted(int(i) for batch in made for i in np.asarray(batch["id"]).ravel())


def test_a_revisions_files_are_listed_and_read_with_ranged_requests_and_the_token(
    hub: LocalHub,
) -> None:
    options = {"endpoint": hub.endpoint, "token": "hf_from_options"}
    assert epoch_ids(loader(URLS, options)) == list(range(sum(SIZES)))
    # (huggingface_hub asks other routes of its own, without the token: not the dataset's)
    requests = [r for r in hub.requests if "datasets/" in r.path]
    assert requests and all(r.authorization == "Bearer hf_from_options" for r in requests)
    assert all(r.status in (200, 206) for r in requests), [r for r in requests if r.status > 206]
    reads = [r for r in requests if "/resolve/" in r.path]
    assert reads and all(r.path.startswith(f"/datasets/{REPO}/resolve/v1/data/") for r in reads)
    assert all(r.range.startswith("bytes=") for r in reads)
    # past each file's footer (its tail: these small files whole), each read is one row group's
    # chunks of the two columns asked, a few hundred bytes: no block read ahead, no whole file
    spans, seen = [], set()
    for read in reads:
        if read.path in seen:
            first, last = read.range[len("bytes=") :].split("-")
            spans.append(int(last) - int(first) + 1)
        seen.add(read.path)
    assert len(spans) >= 5 and max(spans) < 1024, [r.range for r in reads]
    assert not any("/main" in r.path for r in requests)  # (the revision named, not main)
    # a directory of the repository, at the same revision, gives the same files
    hub.requests.clear()
    directory = f"hf://datasets/{REPO}@v1/data"
    assert epoch_ids(loader(directory, options, workers=1)) == list(range(sum(SIZES)))


def test_a_429_from_the_hub_is_retried(hub: LocalHub) -> None:
    # (the revision's information, which huggingface_hub asks without retrying it itself)
    hub.throttle("/revision/v1", 2)
    options = {"endpoint": hub.endpoint}
    assert epoch_ids(loader(URLS, options, workers=1)) == list(range(sum(SIZES)))
    throttled = [r for r in hub.requests if r.status == 429]
    assert [r.path for r in throttled] == [f"/api/datasets/{REPO}/revision/v1"] * 2


def test_an_unreachable_hub_is_named_at_once(hub: LocalHub) -> None:
    options = {"endpoint": "http://127.0.0.1:9"}  # (nothing listens there)
    started = time.monotonic()
    with pytest.raises(
        ConnectionError,
        match=r"cannot connect to the store at http://127\.0\.0\.1:9 \(listing "
        rf"hf://datasets/{REPO}@v1/data/\*\.parquet\)",
    ):
        loader(URLS, options, workers=1)
    assert time.monotonic() - started < 30  # (no retries of a refused connection)


def run(code: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done


def test_the_endpoint_and_the_token_come_from_the_environment(hub: LocalHub) -> None:
    """HF_ENDPOINT and HF_TOKEN, as huggingface_hub reads them (in a process of its own: it
    reads HF_ENDPOINT as it is imported)."""
    code = """
        import sys, time
        from workers.sources.parquet._plan import list_parquet
        from workers.sources.storage import storage_for

        url = sys.argv[1]
        storage = storage_for(url)
        files = list_parquet(url, storage)
        print(storage.endpoint)
        print(" ".join(files))
        print(bytes(storage.read(files[0], 0, 4)).decode())
        """
    env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_TOKEN": "hf_from_environment"}
    done = run(code, env, URLS)
    endpoint, files, magic = done.stdout.split("\n")[:3]
    assert endpoint == hub.endpoint
    assert files.split() == [
        f"hf://datasets/{REPO}@v1/data/train-{n:05d}.parquet" for n in range(len(SIZES))
    ]
    assert magic == "PAR1"
    asked = [r for r in hub.requests if "datasets/" in r.path]
    assert asked and all(r.authorization == "Bearer hf_from_environment" for r in asked)
    assert asked[-1].range == "bytes=0-3"  # (the range asked, no block read ahead)

    # nothing listening at HF_ENDPOINT: the store is named unreachable at once
    code = """
        import sys, time
        from workers.sources.parquet._plan import list_parquet
        from workers.sources.storage import storage_for

        started = time.monotonic()
        try:
            list_parquet(sys.argv[1], storage_for(sys.argv[1]))
        except ConnectionError as error:
            print(f"{time.monotonic() - started:.1f} {error}")
        """
    done = run(code, {**env, "HF_ENDPOINT": "http://127.0.0.1:9"}, URLS)
    seconds, _, said = done.stdout.strip().partition(" ")
    assert said.startswith(
        f"cannot connect to the store at http://127.0.0.1:9 (listing {URLS}): "
    ), said
    assert float(seconds) < 10


def test_without_huggingface_hub_an_hf_url_names_the_package_and_the_extra(
    tmp_path: Path,
) -> None:
    """In an environment of the same packages but huggingface_hub."""
    import sysconfig

    site = Path(sysconfig.get_paths()["purelib"])
    bare = tmp_path / "site"
    bare.mkdir()
    for entry in site.iterdir():
        if not entry.name.lower().startswith("huggingface_hub"):
            (bare / entry.name).symlink_to(entry)
    code = """
        import importlib.util
        from workers.sources.storage import StorageLibraryError, check_storage_libraries
        from workers.sources.storage import storage_for

        assert importlib.util.find_spec("huggingface_hub") is None
        url = "hf://datasets/someone/images@v1/data/*.parquet"
        for attempt in (lambda: check_storage_libraries([url]), lambda: storage_for(url)):
            try:
                attempt()
            except StorageLibraryError as error:
                print(error)
        """
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{bare}", "PYTHONNOUSERSITE": "1"}
    done = subprocess.run(
        [sys.executable, "-S", "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    said = done.stdout.strip().split("\n")
    assert (
        said
        == [
            "reading hf:// URLs needs huggingface_hub>=0.23, which is not installed: "
            'pip install "dali-capture-loader[hub]"'
        ]
        * 2
    ), done.stdout
