"""``python -m loader.tars``: the offline tar tools, a command the user runs (``write`` an
ImageFolder as tar shards, ``index`` a dataset of them -- or of Parquet files -- once); see
:mod:`loader.tars._command`.

Owns the command line of those tools. May import: :mod:`workers` (its face), :mod:`ipc`, the
standard library. Only the command line imports it (``python -m loader index`` is its
``index``).
"""

from ._command import main

__all__ = ["main"]
