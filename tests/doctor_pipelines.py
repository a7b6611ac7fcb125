"""Sources for ``python -m loader doctor --source MOD:FUNC`` in the tests: a module-level function
takes only the shard (and ``batch_size``), so where the data is comes from the environment, as
it would in a user's own module."""

from __future__ import annotations

import os
from typing import Any

from loader import Shard
from tests import tar_pipelines as T

#: The S3 endpoint (a moto server's URL) and the shards' URL pattern.
ENDPOINT = "DOCTOR_S3_ENDPOINT"
URLS = "DOCTOR_S3_URLS"


def s3_id_tars(shard: Shard, batch_size: int = 4) -> Any:
    """sharded_tars over the shards at ``$DOCTOR_S3_URLS`` on the server at
    ``$DOCTOR_S3_ENDPOINT`` (outputs: cls, id; step: tests.tar_pipelines:cls_id_step)."""
    missing = [name for name in (ENDPOINT, URLS) if not os.environ.get(name)]
    if missing:
        raise RuntimeError(f"set {' and '.join(missing)} (the S3 endpoint and the shards' URLs)")
    options = {
        "key": "testing",
        "secret": "testing",
        "endpoint_url": os.environ[ENDPOINT],
        "client_kwargs": {"region_name": "us-east-1"},
    }
    return T.id_tars(shard, os.environ[URLS], batch_size=batch_size, storage_options=options)
