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

from ipc import limits, wire
from ipc.signals import STACK_SIGNAL
from workers import FAILING_SAMPLES

from ..config import died_early_hint
from ..errors import (
    AgreementError,
    RemoteTraceback,
    SharedMemoryError,
    StartupError,
    WorkerDiedError,
    WorkerError,
    WorkerTimeoutError,
)
from ..processes import describe_exit
from ._session import SessionView

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
        "an ExternalSource root must yield full batches: pass a dataset definition "
        "(SamplesDataset(total, load)...) as the source, or return sharded_source() from it; "
        "either pads (flagging padded rows) or drops the last partial batch.",
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


def where(view: SessionView, epoch: int | None, step: int | None) -> str:
    parts = [f"worker {view.index}", view.shard.describe()]
    parts.append(f"epoch {epoch}" if epoch is not None else "before the first epoch")
    if step is not None:
        parts.append(f"step {step}")
    return ", ".join(parts)


def relayed(view: SessionView, failure: wire.WorkerFailure) -> BaseException:
    """A worker's exception (``WorkerFailure``) as the trainer raises it."""
    step = failure.step
    if step is not None:
        step = view.step_of(failure.epoch, step)  # the epoch's, not this process's
    message = f"{failure.message} [{where(view, failure.epoch, step)}, in {failure.phase}]"
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
        ("worker", view.index),
        ("shard", view.shard.index),
        ("epoch", failure.epoch),
        ("step", step),
        ("phase", failure.phase),
        ("remote_traceback", failure.traceback),
    ):
        with contextlib.suppress(AttributeError):
            setattr(error, name, value)
    error.__cause__ = RemoteTraceback(failure.traceback)
    return error


def relay_warning(view: SessionView, relay: wire.WarningRelay) -> None:
    """Re-emit a worker's warning in the trainer (its category when it is a builtin one)."""
    if NOTHING_CAPTURED in relay.message:
        return  # reported once, for all workers, by disagreement()
    category: type[Warning] = UserWarning
    if relay.category_module == "builtins":
        found = getattr(builtins, relay.category_name, None)
        if isinstance(found, type) and issubclass(found, Warning):
            category = found
    warnings.warn_explicit(
        f"[worker {view.index}] {relay.message}",
        category,
        relay.filename,
        relay.lineno,
        module=f"worker{view.index}",
    )


def died(view: SessionView) -> tuple[BaseException, str]:
    """The error a dead worker raises, and a one-line cause for a restart's log record."""
    handle = view.handle
    handle.process.join(0.5)
    exitcode = handle.process.exitcode
    text, signal_name = describe_exit(exitcode)
    stack = handle.read_stack(0.2)
    handle.mark_exited()
    oom = out_of_memory(handle.oom_kills_at_start) if signal_name == "SIGKILL" else None
    last = (
        "no batch yet"
        if view.last_step is None
        else f"last step sent {view.epoch_step(view.last_step)}"
    )
    if oom is not None:
        making = (
            "its first step"
            if view.last_step is None
            else f"step {view.epoch_step(view.last_step) + 1}"
        )
        text = f"was killed by the kernel's out-of-memory killer (SIGKILL) while making {making}"
    unexpectedly = "" if oom is not None else " unexpectedly"
    message = f"{view.describe()} {text}{unexpectedly} [{where(view, view.epoch, None)}, {last}]"
    if oom is not None:
        message += f": {oom}"
    if stack.strip():
        message += f"\n--- worker stack (faulthandler) ---\n{stack.rstrip()}"
    elif view.hello is None and exitcode == 1:
        message += f": {died_early_hint()}"
    error = WorkerDiedError(
        message,
        worker=view.index,
        pid=handle.pid,
        exitcode=exitcode,
        signal_name=signal_name,
        out_of_memory=oom is not None,
    )
    cause = f"{text}" + (f"; its stack: {top_frames(stack)}" if stack.strip() else "")
    return error, cause


def out_of_memory(before: dict[str, int]) -> str | None:
    """What ran out, when an out-of-memory kill counter grew since ``before`` (a worker's
    start); None when none did (a ``SIGKILL`` from something else)."""
    grew = limits.oom_grew(before, limits.oom_kills())
    if not grew:
        return None
    memory = limits.memory_limit()
    if memory is not None and str(memory.directory) in grew:
        where_ = (
            f"its memory cgroup's limit of {memory.limit / 2**20:,.0f} MiB "
            f"({memory.directory}) was reached"
        )
    elif any(name != "vmstat" for name in grew):
        where_ = f"a memory cgroup's limit was reached ({', '.join(sorted(grew))})"
    else:
        where_ = "the machine ran out of memory"
    return (
        f"{where_}. Give the job more memory (the container's memory limit), or make each "
        "worker hold less: fewer workers (num_workers), a smaller batch_size or prefetch, "
        "smaller decoded images, and for Parquet or tars less read ahead (ahead=1, a smaller "
        "ahead_bytes, shuffle_window=1; a Parquet worker holds several times its largest row "
        "group: smaller row groups); a sample that decodes to far more than others may be the "
        "cause"
    )


def read_stack(view: SessionView) -> str:
    """Every thread's stack of ``view``'s live process (faulthandler's), or ""."""
    handle = view.handle
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


def not_started(view: SessionView, timeout: float) -> StartupError:
    """The error of a worker that sent nothing for ``timeout`` (``startup_timeout``) before
    its Hello: what it was doing (the last ``wire.Starting`` it sent) and its stack."""
    return StartupError(
        f"{view.describe()} did not start: it sent nothing for {timeout:g} s "
        f"(startup_timeout) and has not said Hello; {view.doing()}. The machine may be "
        "overloaded, or that step hangs (the stack below says where)"
        + _stack_text(read_stack(view))
    )


def timed_out(view: SessionView, timeout: float, setting: str) -> tuple[BaseException, str]:
    """The error a worker that sent nothing for ``timeout`` (``setting`` says where that limit
    comes from) raises, its stack read first; and a cause for a restart's log. The sample a
    ``load`` is stuck on, when there is one, travels as ``error.hung_load``."""
    stack = read_stack(view)
    waiting_for = "its first batch" if view.received == 0 else "a batch"
    step = view.epoch_step(view.received)  # the epoch's, not this process's
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
    if not view.up:  # (a replacement that has not said Hello yet)
        hangs += f"; {view.doing()}"
    message = (
        f"{view.describe()} sent nothing for {timeout:g} s while the trainer waited for "
        f"{waiting_for} ({setting}) [{where(view, view.epoch, step)}]{hangs}"
    ) + _stack_text(stack)
    error = WorkerTimeoutError(
        message,
        worker=view.index,
        stack=stack,
        epoch=view.epoch,
        step=step,
        hung_load=hung,
    )
    cause = f"sent nothing for {timeout:g} s ({setting}){hangs}"
    if stack.strip():
        cause += f"; stuck in: {top_frames(stack)}"
    return error, cause


#: Shared slots past this share of a cgroup memory limit (or room under it below
#: :data:`LOW_ROOM`) are warned about: the kernel's out-of-memory killer is near.
SLOTS_SHARE = 0.5
LOW_ROOM = 0.1


def memory_risk(slot_bytes: Sequence[tuple[int, int, int]]) -> str | None:
    """A warning's text when the workers' CPU slots (``(worker, slots, bytes each)``, one per
    worker's current arena) crowd this process's cgroup memory limit, else None."""
    memory = limits.memory_limit()
    if memory is None or not slot_bytes:
        return None
    total = sum(count * size for _, count, size in slot_bytes)
    if total < SLOTS_SHARE * memory.limit and memory.room >= LOW_ROOM * memory.limit:
        return None
    largest = max(size for _, _, size in slot_bytes)
    slots = max(count for _, count, _ in slot_bytes)
    mib = 2**20
    return (
        f"the workers' shared-memory slots hold {total / mib:,.0f} MiB ({len(slot_bytes)} "
        f"workers x up to {slots} slots of up to {largest / mib:,.1f} MiB) under a memory limit "
        f"of {memory.limit / mib:,.0f} MiB ({memory.directory}), of which "
        f"{memory.usage / mib:,.0f} MiB are in use now: the slots count against the limit, and "
        "the kernel's out-of-memory killer ends a worker (or the trainer) when it is reached. "
        "Lower prefetch, num_workers or the batch size, or raise the container's memory limit"
    )


def disagreement(views: Sequence[SessionView]) -> tuple[BaseException | None, list[str]]:
    """Every worker's signature must match the first signed one's: the error when one does
    not, and the workers (described) whose capture fell back to eager execution."""
    signed = [v for v in views if v.signature is not None]
    if not signed:
        return None, []
    reference_view = signed[0]
    reference = reference_view.signature
    assert reference is not None
    expected = reference.agreement_fields()
    for view in signed[1:]:
        assert view.signature is not None
        for field, value in view.signature.agreement_fields().items():
            if value != expected[field]:
                return AgreementError(
                    f"{view.describe()} disagrees with worker {reference_view.index} on "
                    f"{field}: {_short(value)} != {_short(expected[field])}. Every worker must "
                    "trace the same loop: make source(shard) and step() give the same batch "
                    "size, device and outputs on every shard"
                ), []
    fell_back = [
        f"{v.index} ({v.shard.describe()})"
        for v in signed
        if v.signature and v.signature.capture_requested and not v.signature.captured
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
