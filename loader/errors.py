"""The loader's exceptions. Runs in the trainer.

Errors raised *inside* a worker keep their own builtin type (``ValueError``, DALI's
``RuntimeError``...) and only gain context in their message; the classes here are for what only a
multiprocess loader can go through.
"""

from __future__ import annotations

from typing import Any

import ipc


class LoaderError(RuntimeError):
    """Base class of the loader's own errors."""


class WorkerError(LoaderError):
    """A worker raised an exception whose type cannot be re-created in the trainer."""

    def __init__(self, message: str, *, remote_type: str = "") -> None:
        super().__init__(message)
        self.remote_type = remote_type


class WorkerDiedError(LoaderError):
    """A worker process ended without being asked to (signal, ``os._exit``, crash)."""

    def __init__(
        self,
        message: str,
        *,
        worker: int,
        pid: int | None,
        exitcode: int | None,
        signal_name: str | None,
        out_of_memory: bool = False,
    ) -> None:
        super().__init__(message)
        self.worker = worker
        self.pid = pid
        self.exitcode = exitcode
        self.signal_name = signal_name
        #: True when the kernel's out-of-memory killer took it (a cgroup's or the machine's
        #: ``oom_kill`` counter grew while it ran, and it died of ``SIGKILL``)
        self.out_of_memory = out_of_memory


class WorkerTimeoutError(LoaderError):
    """No batch came from a live worker within ``timeout`` seconds."""

    def __init__(
        self,
        message: str,
        *,
        worker: int,
        stack: str,
        epoch: int | None = None,
        step: int | None = None,
        hung_load: Any = None,
    ) -> None:
        super().__init__(message)
        self.worker = worker
        self.stack = stack
        self.epoch = epoch
        self.step = step  # the step the trainer was waiting for
        #: the sample whose ``load`` hangs in the worker, when that is why it sent nothing
        self.hung_load = hung_load


class StartupError(LoaderError):
    """The worker pool could not start."""


class AgreementError(LoaderError):
    """Workers (or ranks) disagree on batch size, device, context or outputs."""


class SlotsExhaustedError(LoaderError):
    """The trainer holds every shared-memory slot of the worker it waits on."""


class SharedMemoryError(LoaderError, ipc.SharedMemoryError):
    """Shared memory for a worker's slots could not be reserved (also a ``MemoryError``)."""


class SkipLimitError(LoaderError):
    """With ``on_error="skip"``, more samples failed than ``max_skipped``: not bad data but a
    broken pipeline."""


class LoaderClosedError(LoaderError):
    """The loader was closed, or shut down after a failure, and cannot be iterated."""


class RemoteTraceback(Exception):
    """Carries a worker's traceback text; set as ``__cause__`` of a relayed error."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f"\n\n--- traceback in the worker ---\n{self.text}"
