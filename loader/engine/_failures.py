"""What goes wrong in a worker, as the exception the trainer raises. Runs in the trainer.

Every function here *returns* an exception (and, for a restart's log, a one-line cause); the
coordinator or its wait (:mod:`loader.engine._waiting`) decides whether to raise it or to heal.
The worker, shard, epoch and step are in every message; a worker's exception arrives as the same
class when the trainer knows it.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from ipc import wire
from ipc.signals import STACK_SIGNAL
from workers import FAILING_SAMPLES

from .._errors import (
    AgreementError,
    RemoteTraceback,
    SharedMemoryError,
    StartupError,
    WorkerDiedError,
    WorkerError,
    WorkerTimeoutError,
)
from ..config._validate import MAIN_GUARD_HINT
from ..processes._pool import describe_exit
from ._session import WorkerSession

NOTHING_CAPTURED = "no operators were captured"

#: Exception types of ``ipc`` a worker may raise, and the loader's class the trainer raises.
KNOWN_TYPES: dict[tuple[str, str], type[Exception]] = {
    ("ipc._arena", "SharedMemoryError"): SharedMemoryError,
}

#: Known DALI messages, and what to change in the loader's terms.
HINTS = (
    (
        "Checkpointing is currently not supported in capture mode",
        "the loader runs DALI capture mode, which cannot checkpoint: build the reader in "
        "source() without enable_checkpointing=True (or pass capture=False to Loader).",
    ),
    (
        "Expected batch size",
        "an ExternalSource root must yield full batches: build it with sharded_source(), which "
        "pads (flagging padded rows) or drops the last partial batch.",
    ),
    (
        "cannot switch to capture mode",
        "source() must return a reader that was never iterated; the loader iterates it.",
    ),
    (
        "Inconsistent batch size",
        "an operator in step() got batches of two sizes, one of them not the Loader's "
        "batch_size (a hard-coded batch_size=?): take it from a batch, e.g. "
        "ndd.random.coin_flip(probability=0.5, batch_size=images.batch_size).",
    ),
)


#: Added to an error that names the samples failing alone (only ``on_error="raise"`` raises it).
SKIP_HINT = (
    'on_error="skip" leaves samples that fail out of the batches (each flagged in '
    "batch.info.skipped); DALI's whole error text is in error.remote_traceback."
)


def where(session: WorkerSession, epoch: int | None, step: int | None) -> str:
    parts = [f"worker {session.index}", session.shard.describe()]
    parts.append(f"epoch {epoch}" if epoch is not None else "before the first epoch")
    if step is not None:
        parts.append(f"step {step}")
    return ", ".join(parts)


def relayed(session: WorkerSession, failure: wire.WorkerFailure) -> BaseException:
    """A worker's exception (``WorkerFailure``) as the trainer raises it."""
    step = failure.step
    if step is not None and failure.epoch == session.epoch:
        step = session.epoch_step(step)  # the epoch's, not this process's
    message = f"{failure.message} [{where(session, failure.epoch, step)}, in {failure.phase}]"
    for pattern, hint in HINTS:
        if pattern in failure.message:
            message += f" Hint: {hint}"
    if failure.message.startswith(FAILING_SAMPLES):
        message += f" Hint: {SKIP_HINT}"
    error, why_not = rebuild_exception(failure.type_module, failure.type_name, message)
    if error is None:
        remote = f"{failure.type_module}.{failure.type_name}"
        error = WorkerError(f"{remote}: {message}{why_not}", remote_type=remote)
    for name, value in (
        ("worker", session.index),
        ("shard", session.shard.index),
        ("epoch", failure.epoch),
        ("step", step),
        ("phase", failure.phase),
        ("remote_traceback", failure.traceback),
    ):
        with contextlib.suppress(AttributeError):
            setattr(error, name, value)
    error.__cause__ = RemoteTraceback(failure.traceback)
    return error


def relay_warning(session: WorkerSession, relay: wire.WarningRelay) -> None:
    """Re-emit a worker's warning in the trainer (its category when it is a builtin one)."""
    if NOTHING_CAPTURED in relay.message:
        return  # reported once, for all workers, by disagreement()
    category: type[Warning] = UserWarning
    if relay.category_module == "builtins":
        found = getattr(builtins, relay.category_name, None)
        if isinstance(found, type) and issubclass(found, Warning):
            category = found
    warnings.warn_explicit(
        f"[worker {session.index}] {relay.message}",
        category,
        relay.filename,
        relay.lineno,
        module=f"worker{session.index}",
    )


def died(session: WorkerSession) -> tuple[BaseException, str]:
    """The error a dead worker raises, and a one-line cause for a restart's log record."""
    handle = session.handle
    handle.process.join(0.5)
    exitcode = handle.process.exitcode
    text, signal_name = describe_exit(exitcode)
    stack = handle.read_stack(0.2)
    handle.mark_exited()
    last = (
        "no batch yet"
        if session.last_step is None
        else f"last step sent {session.epoch_step(session.last_step)}"
    )
    message = (
        f"{session.describe()} {text} unexpectedly [{where(session, session.epoch, None)}, {last}]"
    )
    if stack.strip():
        message += f"\n--- worker stack (faulthandler) ---\n{stack.rstrip()}"
    elif session.hello is None and exitcode == 1:
        message += f": {MAIN_GUARD_HINT}"
    error = WorkerDiedError(
        message,
        worker=session.index,
        pid=handle.pid,
        exitcode=exitcode,
        signal_name=signal_name,
    )
    cause = f"{text}" + (f"; its stack: {top_frames(stack)}" if stack.strip() else "")
    return error, cause


def read_stack(session: WorkerSession) -> str:
    """Every thread's stack of ``session``'s live process (faulthandler's), or ""."""
    handle = session.handle
    if handle.pid is None or handle.exited:
        return ""
    try:
        os.kill(handle.pid, STACK_SIGNAL)
        return handle.read_stack(1.5)
    except (ProcessLookupError, OSError):
        return ""


def _stack_text(stack: str) -> str:
    if not stack.strip():
        return "\n(the worker's stack could not be read)"
    return f"\n--- worker stack (faulthandler) ---\n{stack.rstrip()}"


def not_started(session: WorkerSession, timeout: float) -> StartupError:
    """The error of a worker that sent nothing for ``timeout`` (``startup_timeout``) before
    its Hello: what it was doing (the last ``wire.Starting`` it sent) and its stack."""
    return StartupError(
        f"{session.describe()} did not start: it sent nothing for {timeout:g} s "
        f"(startup_timeout) and has not said Hello; {session.doing()}. The machine may be "
        "overloaded, or that step hangs (the stack below says where)"
        + _stack_text(read_stack(session))
    )


def timed_out(session: WorkerSession, timeout: float, setting: str) -> tuple[BaseException, str]:
    """The error a worker that sent nothing for ``timeout`` (``setting`` says where that limit
    comes from) raises, its stack read first; and a cause for a restart's log. The sample a
    ``load`` is stuck on, when there is one, travels as ``error.hung_load``."""
    stack = read_stack(session)
    waiting_for = "its first batch" if session.received == 0 else "a batch"
    step = session.epoch_step(session.next_step)  # the epoch's, not this process's
    # the sample a load has been stuck on since (about) the wait began hangs; a load that
    # started later is merely the one running when the wait, for a slow batch, ran out
    running = wire.LoadRunning.find(stack)
    hung = running if running is not None and running.seconds >= timeout / 2 else None
    hangs = ""
    if hung is not None:
        named = (
            f"sample {hung.index}"
            if hung.name == str(hung.index)
            else f"sample {hung.index} ({hung.name})"
        )
        hangs = f"; its load() hangs on {named} (running for {hung.seconds:.1f} s)"
    if not session.up:  # (a replacement that has not said Hello yet)
        hangs += f"; {session.doing()}"
    message = (
        f"{session.describe()} sent nothing for {timeout:g} s while the trainer waited for "
        f"{waiting_for} ({setting}) [{where(session, session.epoch, step)}]{hangs}"
    ) + _stack_text(stack)
    error = WorkerTimeoutError(
        message,
        worker=session.index,
        stack=stack,
        epoch=session.epoch,
        step=step,
        hung_load=hung,
    )
    cause = f"sent nothing for {timeout:g} s ({setting}){hangs}"
    if stack.strip():
        cause += f"; stuck in: {top_frames(stack)}"
    return error, cause


def disagreement(sessions: Sequence[WorkerSession]) -> tuple[BaseException | None, list[str]]:
    """Every worker's signature must match the first signed one's: the error when one does
    not, and the workers (described) whose capture fell back to eager execution."""
    signed = [s for s in sessions if s.signature is not None]
    if not signed:
        return None, []
    reference_session = signed[0]
    reference = reference_session.signature
    assert reference is not None
    expected = reference.agreement_fields()
    for session in signed[1:]:
        assert session.signature is not None
        for field, value in session.signature.agreement_fields().items():
            if value != expected[field]:
                return AgreementError(
                    f"{session.describe()} disagrees with worker {reference_session.index} on "
                    f"{field}: {_short(value)} != {_short(expected[field])}. Every worker must "
                    "trace the same loop: make source(shard) and step() give the same batch "
                    "size, device and outputs on every shard"
                ), []
    fell_back = [
        f"{s.index} ({s.shard.describe()})"
        for s in signed
        if s.signature and s.signature.capture_requested and not s.signature.captured
    ]
    return None, fell_back


def warn_fallback(names: Sequence[str]) -> None:
    warnings.warn(
        f"capture=True was specified but no operators were captured during tracing in "
        f"worker(s) {', '.join(names)}; they run step() eagerly. Make step() call DALI operators "
        "(arithmetic, slicing and ndd.math are not captured), or pass capture=False",
        UserWarning,
        stacklevel=6,
    )


def rebuild_exception(
    module_name: str, type_name: str, message: str
) -> tuple[BaseException | None, str]:
    """The worker's exception as the same class in the trainer, when the trainer knows it.

    Builtins and the loader's own errors always; a user's class when its module is already
    imported in the trainer (a class of the main script arrives as ``__mp_main__`` and is looked
    up in ``__main__``). Returns ``(None, why)`` when it cannot be re-created.
    """
    known = KNOWN_TYPES.get((module_name, type_name))
    if known is not None:
        return known(message), ""
    if module_name == "builtins":
        module: Any = builtins
    else:
        module = sys.modules.get("__main__" if module_name == "__mp_main__" else module_name)
        if module is None:
            return None, (
                f" (the trainer has not imported {module_name!r}, so the exception arrives as "
                "WorkerError; import that module in the trainer to catch its class)"
            )
    kind: Any = module
    for part in type_name.split("."):
        kind = getattr(kind, part, None)
    if not (isinstance(kind, type) and issubclass(kind, Exception)):
        return None, f" (the trainer's {module_name} has no exception class {type_name})"
    try:
        return kind(message), ""
    except Exception:
        return None, (
            f" ({module_name}.{type_name} cannot be re-created from a message alone, so it "
            "arrives as WorkerError)"
        )


def top_frames(stack: str, count: int = 3) -> str:
    """The innermost frames where the worker is stuck, on one line, from a faulthandler dump:
    the thread inside a sample's ``load`` when there is one (samples are loaded on a prefetch
    thread), else the thread that took the signal (the main thread, where the loop runs)."""
    blocks: list[tuple[str, list[str]]] = []
    for line in stack.strip().splitlines():
        if line.startswith(("Thread ", "Current thread ")):
            blocks.append((line, []))
        elif line.strip().startswith("File ") and blocks:
            blocks[-1][1].append(line.strip())
    loading = [frames for _, frames in blocks if any(" in _load" in f for f in frames)]
    current = [frames for header, frames in blocks if header.startswith("Current thread")]
    frames = (loading or current or [frames for _, frames in blocks[-1:]] or [[]])[0]
    return " <- ".join(frames[:count]) or stack.strip()[-200:]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 300 else text[:297] + "..."
