"""pyarrow is the [parquet] extra: named when missing, never imported by ``import loader``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from workers.sources.parquet._arrow import pyarrow_modules


def test_a_missing_pyarrow_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match=r"dali-capture-loader\[parquet\]"):
        pyarrow_modules()


def test_import_loader_does_not_import_pyarrow() -> None:
    code = "import sys, loader; print('pyarrow' in sys.modules)"
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert found.stdout.strip() == "False"
