"""pyarrow, imported where the Parquet reader first needs it (never by ``import loader``), with
an error that names the extra to install when it is missing. Runs in the worker."""

from __future__ import annotations

from typing import Any

from ... import startup

__all__ = ["EXTRA_HINT", "note_compute", "pyarrow_modules"]

#: How to install what the Parquet reader needs.
EXTRA_HINT = "pip install 'dali-capture-loader[parquet]' (or pip install pyarrow)"


def pyarrow_modules() -> tuple[Any, Any]:
    """``(pyarrow, pyarrow.parquet)``; ``ImportError`` naming the ``[parquet]`` extra when
    pyarrow is not installed."""
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError as error:
        raise ImportError(
            f"reading Parquet needs pyarrow, which is not installed ({error}): {EXTRA_HINT}"
        ) from error
    # The script's next worker server imports both ahead, as it warms: every Parquet loader's
    # definition asks its server for both (``ParquetDataset.server_needs``), so a module left
    # out of the record here is imported on the way to the first batch instead (pyarrow.compute:
    # 0.03 s after DALI, 0.13 s on its own, on the 2-core machine)
    startup.used("pyarrow.parquet")
    startup.used("pyarrow.compute")
    return pyarrow, pyarrow.parquet


def note_compute() -> None:
    """Import ``pyarrow.compute`` (a struct column read by its pages is put together with it)
    and note it, so that the script's next worker server imports it ahead (70 ms a worker
    would otherwise pay before its first batch; noted already where this worker imported
    pyarrow through :func:`pyarrow_modules`)."""
    import pyarrow.compute  # noqa: F401

    startup.used("pyarrow.compute")
