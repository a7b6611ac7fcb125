"""The storage libraries' floors: those the extras declare, compared as versions."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomllib

from workers.sources.storage._libraries import (
    STORAGE_LIBRARIES,
    StorageLibraryError,
    _version_key,
    check_storage_libraries,
    storage_library_problem,
)

ROOT = Path(__file__).resolve().parents[5]


def test_the_floors_are_the_s3_extras() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    declared = dict(re.fullmatch(r"([\w-]+)>=([\d.]+)", item).groups() for item in extras["s3"])  # type: ignore[union-attr]
    assert dict(STORAGE_LIBRARIES["s3"]) == declared


def test_versions_compare_by_their_numbers() -> None:
    assert _version_key("0.4.2") < _version_key("2023.6") <= _version_key("2023.6.0")
    assert _version_key("2025.3.2.post1") > _version_key("2023.6")
    assert _version_key("2023.10.0") > _version_key("2023.6")


def test_local_paths_need_nothing_and_a_missing_backend_is_named() -> None:
    check_storage_libraries(["/data/train-0.tar", "file:///data/x.tar"])
    assert storage_library_problem("s3") is None  # (this environment has the extra)
    with pytest.raises(StorageLibraryError) as raised:
        STORAGE_LIBRARIES["nosuch"] = (("no-such-storage-package", "1.0"),)
        try:
            check_storage_libraries(["nosuch://bucket/x.tar"])
        finally:
            del STORAGE_LIBRARIES["nosuch"]
    assert isinstance(raised.value, ImportError)
    assert "needs no-such-storage-package>=1.0, which is not installed" in str(raised.value)
    assert 'pip install "dali-capture-loader[s3]"' in str(raised.value)


def test_hf_urls_need_huggingface_hub_from_the_hub_extra() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    declared = dict(re.fullmatch(r"([\w-]+)>=([\d.]+)", item).groups() for item in extras["hub"])  # type: ignore[union-attr]
    assert dict(STORAGE_LIBRARIES["hf"]) == declared
    assert storage_library_problem("hf") is None  # (this environment has huggingface_hub)
