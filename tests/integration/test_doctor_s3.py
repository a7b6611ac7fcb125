"""``python -m loader doctor --source MOD:FUNC`` on a ``sharded_tars`` job over S3 (moto's server
on 127.0.0.1, as in test_tars_s3): the source's module finds the store through the environment,
as a user's own module would."""

from __future__ import annotations

import re

import pytest

from tests.doctor_pipelines import ENDPOINT, URLS
from tests.integration.test_cli import run_cli
from tests.integration.test_tars_s3 import PATTERN, Store, store

pytestmark = pytest.mark.timeout(240)

__all__ = ["store"]  # (the fixture, used by name)


def test_doctor_runs_a_sharded_tars_job_over_s3(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENDPOINT, store.endpoint)
    monkeypatch.setenv(URLS, PATTERN)
    result = run_cli(
        "doctor",
        *("--source", "tests.doctor_pipelines:s3_id_tars"),
        *("--step", "tests.tar_pipelines:cls_id_step"),
        *("--batch-size", "4", "--seconds", "1.5", "--headspace", "2"),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert re.search(r"(?m)^(input-bound|not input-bound): the trainer waited [\d.]+%", out), out
    assert re.search(r"(?m)^  suggestion: \S", out), out
    assert re.search(r"(?m)^  load\(\) of sharded_tars: on CPU \d+% of its time", out), out
    assert re.search(r"(?m)^  with the loader: [\d.]+ batches/s", out), out
