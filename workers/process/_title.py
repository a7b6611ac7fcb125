"""Process titles: what ``ps``, ``top`` and ``pgrep`` show for the loader's own processes.

The worker server shows as ``dali-loader-server`` and worker *k* of a pool as
``dali-loader-worker-k``; both add ``(trainer <pid>)``, so the processes of several trainers on
one node can be told apart. The title replaces the command line (``ps -f``, ``pgrep -f``); the
short name (``ps -o comm``, ``top``, ``psutil.Process.name()``) is ``dali-loader-srv`` or
``dali-loader-wK`` (15 characters at most, the kernel's limit). Runs in the server and the
workers, never in the trainer.

The environment stays intact: ``setproctitle`` is told (``SPT_NOENV``, read when it first sets
a title) to write the title over the command line's own bytes only, never over the environment's,
so ``/proc/<pid>/environ`` (``ps e``, ``psutil.Process.environ()``, the job exporters and
cleaners that attribute processes to jobs by ``SLURM_JOB_ID`` or a pod's variables) reads what
the process inherited. ``SPT_NOENV`` is set for that first call only, then removed again (unless
the process inherited it): ``os.environ`` and what the process's children inherit stay the
trainer's.

The title then has the room of the command line the process started with (the trainer's, for a
server forked from it), less a byte. Where the whole title does not fit (``python -c`` with short
code, ``python -`` reading a heredoc), it degrades to the most useful part that does (:func:`fit`):
the name without the trainer (``dali-loader-worker-3``), then the short name
(``dali-loader-w3``), then as much of the short name as fits. The short name is always set whole.
"""

from __future__ import annotations

import ctypes
import logging
import os

logger = logging.getLogger("loader")

SERVER_TITLE = "dali-loader-server"
WORKER_TITLE = "dali-loader-worker-{worker}"
SERVER_SHORT = "dali-loader-srv"
WORKER_SHORT = "dali-loader-w{worker}"

#: What tells ``setproctitle`` to leave the environment's memory alone.
NOENV = "SPT_NOENV"
#: The kernel's limit on a short name (``/proc/<pid>/comm``), in bytes.
SHORT_LIMIT = 15

_PR_SET_NAME = 15


def server_title(trainer_pid: int) -> str:
    return f"{SERVER_TITLE} (trainer {trainer_pid})"


def worker_title(worker: int, trainer_pid: int) -> str:
    return f"{WORKER_TITLE.format(worker=worker)} (trainer {trainer_pid})"


def short_name(title: str) -> str:
    """The short name of ``title`` (at most :data:`SHORT_LIMIT` characters)."""
    name = title.split(" ", 1)[0]
    if name == SERVER_TITLE:
        return SERVER_SHORT
    if name.startswith(WORKER_TITLE.format(worker="")):
        return WORKER_SHORT.format(worker=name.rsplit("-", 1)[1])[:SHORT_LIMIT]
    return name[:SHORT_LIMIT]


def fit(title: str, room: int) -> str:
    """What of ``title`` shows in a command line of ``room`` characters: the whole title, else
    its name alone, else the short name, else as much of the short name as fits."""
    name, short = title.split(" ", 1)[0], short_name(title)
    for candidate in (title, name, short):
        if len(candidate.encode()) <= room:
            return candidate
    return short[: max(0, room)]


def title_room() -> int:
    """Characters a title can take in this process's command line (its bytes, less the two
    NULs ``setproctitle`` keeps at the end): the command line's room, not the environment's."""
    try:
        with open("/proc/self/cmdline", "rb") as cmdline:
            return max(0, len(cmdline.read()) - 2)
    except OSError:
        return 0


def set_title(title: str) -> None:
    """Set this process's title (over its command line, :func:`fit` to its room; its
    environment left intact, see the module docstring) and its short name. Never fails: a
    title is a courtesy."""
    shown = fit(title, title_room())
    inherited = NOENV in os.environ
    try:
        if not inherited:
            os.environ[NOENV] = "1"  # (before the import: older versions set up there)
        try:
            import setproctitle

            setproctitle.setproctitle(shown)
        finally:
            if not inherited:
                os.environ.pop(NOENV, None)
    except Exception:  # not installed, or the platform refuses: the short name still helps
        logger.debug("process title not set", exc_info=True)
    short = short_name(title).encode("ascii", "replace")[:SHORT_LIMIT]
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(short), 0, 0, 0)
    except (OSError, AttributeError):
        logger.debug("process name not set", exc_info=True)
