"""What the worker knows of an error beyond the error itself. Runs in the worker.

Here, at the bottom of ``workers``, so that the sources (which write it) and the transport (which
reads it) share it without importing each other.

An error can say less than the worker knows about it: a ``load`` that raised ran on the prefetch
thread for one sample (the worker's own phase then reads ``dali``: DALI pulled the source), and
a batch that failed may have been searched for the samples that fail alone (the message should
name them first). That knowledge travels with the error as one :class:`ErrorContext`:

* written where it is learnt: :func:`attach` in ``BatchedSamples._load`` (the phase, ``load,
  sample 14``) and in :mod:`workers.capture._isolation` (the message naming the failing samples);
* read where the error is handled: :func:`context_of` in
  :func:`workers.capture._isolation.can_isolate` (a failed ``load`` is not searched again) and in
  :func:`workers.transport._error_text.failure` (the record the trainer gets).

This module owns the storage; nothing else reads or writes it. The context lives exactly as long
as its error, on whatever thread and through whatever frames (DALI's included) the error passes:
it is kept in the error's ``__dict__`` under one private key, as Python keeps ``__notes__``. (A
side table cannot do it: a weak one refuses the built-in exceptions a ``load`` raises --
``ValueError`` and ``OSError`` are not weakly referenceable -- and a strong one would keep every
error, its traceback and the batch in its frames alive after the error was handled.)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

#: The one key under which an error carries its context (see the module docstring).
_KEY = "_worker_error_context"


@dataclass(frozen=True, slots=True)
class ErrorContext:
    """What the worker knows of an error: ``phase``, where it happened when the worker's own
    phase does not say it (``load, sample 14``); ``message``, what the trainer's exception
    says in place of the error's own text (the failing samples named first). None: not known."""

    phase: str | None = None
    message: str | None = None


#: The context of an error nothing was attached to.
UNKNOWN = ErrorContext()


def attach(error: BaseException, *, phase: str | None = None, message: str | None = None) -> None:
    """Add to ``error``'s context: a field given replaces what was attached before, a field
    left None keeps it. Safe on any thread (the error is the caller's alone while it raises)."""
    known = context_of(error)
    vars(error)[_KEY] = replace(
        known,
        phase=known.phase if phase is None else phase,
        message=known.message if message is None else message,
    )


def context_of(error: BaseException) -> ErrorContext:
    """What was attached to ``error``; :data:`UNKNOWN` when nothing was."""
    found = vars(error).get(_KEY)
    return found if isinstance(found, ErrorContext) else UNKNOWN
