"""sharded_tars over an object store: a real S3-protocol server (moto's, on 127.0.0.1), real s3fs
in the workers, real boto3 in the test."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loader import Loader
from tests import tar_pipelines as T

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
    source = functools.partial(T.id_tars, urls=PATTERN, storage_options=store.options, **kw)
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
        with pytest.raises(OSError, match=rf"s3://{BUCKET}/train-0\d\d\.tar"):
            for _ in iterator:
                pass


def test_a_missing_shard_wrong_credentials_or_an_unreachable_endpoint_fail_at_start(
    store: Store,
) -> None:
    store.delete(["train-007.tar"])
    with pytest.raises(FileNotFoundError, match=rf"s3://{BUCKET}/train-007\.tar"):
        make(store, 1, 0, 1)
    store.require_credentials(True)
    with pytest.raises(PermissionError, match=rf"s3://{BUCKET}/.* denied .*check the credentials"):
        make(store, 1, 0, 1)
    store.require_credentials(False)
    # nothing listens on port 9: s3fs tries once, the source twice (logged), then names it
    unreachable = dict(
        store.options,
        endpoint_url="http://127.0.0.1:9",
        config_kwargs={"retries": {"max_attempts": 1}, "connect_timeout": 2},
    )
    source = functools.partial(T.id_tars, urls=PATTERN, storage_options=unreachable, retries=1)
    with pytest.raises(OSError, match=rf"s3://{BUCKET}/\S* failed: EndpointConnectionError"):
        Loader(source, T.cls_id_step, batch_size=4, num_workers=1)
