"""What a worker's error says to the trainer: DALI's long error text condensed to its operator
and cause, and the samples found to fail named first. Runs in the worker.

DALI 2.4 words a failure in a captured pipeline as about 20 lines: "Critical error in pipeline",
the traceback of DALI's own graph-building code, then ``Error in CPU operator
`nvidia.dali.ops.decoders.Image``` and, after "encountered:", the cause (sometimes followed by
a C++ context line or stack trace). A failure in an eagerly run step (the traced first step, or
a sample re-run alone) reads "An error happened during asynchronous execution", raised from the
operator's own error, and names no operator. Either way the message sent to the trainer is one
line: ``CPU operator decoders.Image failed: nvImageCodec failure: '#3'``; DALI's whole text
travels in the worker's traceback (the trainer's ``remote_traceback`` and ``__cause__``).

When the worker has found the samples that fail alone (:mod:`workers.capture._isolation`), the
message starts with :data:`FAILING_SAMPLES` and names them, and the trainer adds the hint that
``on_error="skip"`` leaves them out. :func:`failure` makes the record the trainer gets, from the
error and what the worker knows of it (:mod:`workers.spec._error_context`).
"""

from __future__ import annotations

import re
import traceback
from collections.abc import Sequence

from ipc import wire

from ..spec import context_of

#: How a message naming the samples that fail alone starts (``failing sample 14 (/a/b.jpg):
#: ...``); the trainer adds the ``on_error="skip"`` hint to such a message.
FAILING_SAMPLES = "failing sample"

#: The most characters of DALI's cause kept in the message (the rest is in the traceback).
CAUSE_LIMIT = 300

_OPERATOR = re.compile(r"^Error in (\w+) operator `(?:nvidia\.dali\.(?:ops|fn)\.)?([^`]+)`")
_WRAPPERS = (
    "An error happened during asynchronous execution",
    "An error happened during deferred evaluation",
)
#: lines after DALI's cause that only DALI's developers read, and the pipeline's epitaph
_AFTER_CAUSE = ("C++ context:", "Stacktrace (", "Current pipeline object is no longer valid")


def dali_summary(error: BaseException) -> tuple[str | None, str] | None:
    """The operator (``CPU operator decoders.Image``, None when DALI does not say) and the cause
    of a DALI error, on one line; None for an error DALI did not word."""
    text = str(error)
    lines = [line.strip() for line in text.splitlines()]
    named = next((found for line in lines if (found := _OPERATOR.match(line))), None)
    if named is not None and "encountered:" in lines:
        cause = _cause(lines[lines.index("encountered:") + 1 :])
        return f"{named.group(1)} operator {named.group(2)}", cause
    if text.strip() in _WRAPPERS and error.__cause__ is not None:
        from .. import dali  # (not at import: importing ``workers`` does not import DALI)

        inner = dali_summary(error.__cause__)
        if inner is None:
            return dali.failed_operator(error), _cause(str(error.__cause__).splitlines())
        return inner[0] or dali.failed_operator(error), inner[1]
    return None


def failed_in_decoder(error: BaseException) -> bool:
    """Whether DALI says ``error`` came from one of its decoders (``CPU operator
    decoders.Image``, ``experimental.decoders.*``): the data did not decode, ``step`` is not at
    fault."""
    summary = dali_summary(error)
    operator = summary[0] if summary is not None else None
    if not operator:
        return False
    name = operator.split()[-1]
    return name.startswith("decoders.") or ".decoders." in name


def describe(error: BaseException) -> str:
    """The error in a line when DALI worded it (``CPU operator decoders.Image failed: ...``), or
    its own message."""
    summary = dali_summary(error)
    if summary is None:
        return str(error)
    operator, cause = summary
    return cause if operator is None else f"{operator} failed: {cause}"


def message(error: BaseException, failing: Sequence[str] = (), printed: Sequence[str] = ()) -> str:
    """What the trainer's exception says (before the loader's ``[worker k, ...]``): ``failing``
    (the samples that fail alone, described) first, then the error in a line, then what native
    code printed (``printed``: its log lines) while those samples failed."""
    text = describe(error)
    if printed:
        text += f" (printed: {'; '.join(printed)})"
    return f"failing {', '.join(failing)}: {text}" if failing else text


def every_sample_fails(error: BaseException) -> str:
    """The message when every sample of the failed batch fails alone (no sample is named)."""
    return (
        f"{describe(error)} (every sample of the batch fails alone too: step() or the "
        "pipeline is at fault, not the data)"
    )


def short_reason(error: BaseException, printed: Sequence[str] = ()) -> str:
    """One line for a log (a skipped sample's reason): the type and the error in a line."""
    lines = [line.strip() for line in describe(error).splitlines() if line.strip()]
    text = f"{type(error).__name__}: {' '.join(list(dict.fromkeys(lines))[:3])}"
    if dali_summary(error) is None and error.__cause__ is not None:
        text += f" ({short_reason(error.__cause__)})"
    if printed:
        text += f" (printed: {'; '.join(printed)})"
    return cut(text, CAUSE_LIMIT)


def cut(text: str, limit: int) -> str:
    """``text``, or its first words within ``limit`` characters and `` ...`` (never a word cut
    in two)."""
    if len(text) <= limit:
        return text
    head = text[: limit - 4]
    if " " in head:
        head = head[: head.rindex(" ")]
    return f"{head.rstrip(' ,;:(')} ..."


def failure(
    error: BaseException, *, phase: str, epoch: int | None, step: int | None
) -> wire.WorkerFailure:
    """The record of ``error`` for the trainer: ``phase`` (the worker's) unless the error's
    context names its own, and DALI's long text in a line (the failing samples first when they
    are known); the whole text travels in the traceback."""
    kind, known = type(error), context_of(error)
    return wire.WorkerFailure(
        type_module=kind.__module__,
        type_name=kind.__qualname__,
        message=known.message or message(error),
        traceback="".join(traceback.format_exception(error)),
        epoch=epoch,
        step=step,
        phase=known.phase or phase,
    )


def _cause(lines: Sequence[str]) -> str:
    kept: list[str] = []
    for line in (line.strip() for line in lines):
        if line.startswith(_AFTER_CAUSE):
            break
        if line:
            kept.append(line)
    text = " ".join(kept) or "(DALI gave no cause)"
    return cut(text, CAUSE_LIMIT)
