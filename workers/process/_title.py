"""Process titles: what ``ps``, ``top`` and ``pgrep`` show for the loader's own processes.

The worker server shows as ``dali-loader-server`` and worker *k* of a pool as
``dali-loader-worker-k``; both add ``(trainer <pid>)``, so the processes of several trainers on
one node can be told apart. The full title replaces the command line (``ps -f``, ``pgrep -f``);
the short name (``ps -o comm``, ``top``, ``psutil.Process.name()``) holds its first 15
characters, the kernel's limit. Runs in the server and the workers, never in the trainer.
"""

from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger("loader")

SERVER_TITLE = "dali-loader-server"
WORKER_TITLE = "dali-loader-worker-{worker}"

_PR_SET_NAME = 15


def server_title(trainer_pid: int) -> str:
    return f"{SERVER_TITLE} (trainer {trainer_pid})"


def worker_title(worker: int, trainer_pid: int) -> str:
    return f"{WORKER_TITLE.format(worker=worker)} (trainer {trainer_pid})"


def set_title(title: str) -> None:
    """Set this process's title (its command line where ``setproctitle`` can rewrite it) and
    its short name (the first word, cut to 15 bytes). Never fails: a title is a courtesy."""
    try:
        import setproctitle

        setproctitle.setproctitle(title)
    except Exception:  # not installed, or the platform refuses: the short name still helps
        logger.debug("process title not set", exc_info=True)
    short = title.split(" ", 1)[0].encode("ascii", "replace")[:15]
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(short), 0, 0, 0)
    except (OSError, AttributeError):
        logger.debug("process name not set", exc_info=True)
