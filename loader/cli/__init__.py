"""The command line: ``python -m loader`` (the main job, :mod:`._job`), ``python -m loader
doctor`` (:mod:`._doctor`), over the job's flags they share (:mod:`._flags`), and ``python -m
loader index`` (a dataset's summary written beside it, tar shards or Parquet files: the command
of :mod:`loader.tars`). The only layer that prints.

May import: the public face (``loader``, ``loader.sample``, ``loader.tars``), observation
(``loader.observe``) and configuration (``loader.config``); nothing imports it but
``loader.__main__``.
"""

from __future__ import annotations

import signal
import sys

from ._doctor import doctor
from ._flags import Terminated
from ._job import run_job

__all__ = ["doctor", "main", "run_job"]


def _terminated(signum: int, frame: object) -> None:
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    """``python -m loader [doctor | index] ...``: the exit status. A SIGTERM (a cluster's stop)
    ends the job as Ctrl-C does: its loader closed, its workers stopped, a line saying so."""
    argv = sys.argv[1:] if argv is None else argv
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _terminated)
    if argv[:1] == ["doctor"]:
        return doctor(argv[1:])
    if argv[:1] == ["index"]:
        from loader.tars import main as tars_main

        return tars_main(argv, prog="python -m loader")
    return run_job(argv)
