"""Why a sample's ``load`` failed, as the kind the skip-limit error names
(:data:`ipc.wire.SKIP_KINDS`): told by the exception where the failure is found, never guessed
from its words later. Runs in the worker.

* :class:`MemberMissing` -- a sample lacks a required member (a tar member, a Parquet column's
  value): ``optional=`` is the fix, and the error names the member;
* :class:`SampleLeftOut` -- a planned sample of a shard found cut short since it was indexed:
  data known lost, accounted in ``stats().left_out`` like a shard's damaged tail, and not
  counted against ``max_skipped``;
* an error class may say its kind itself, as a ``skip_kind`` class attribute (an image over
  ``max_image_pixels``, ``ImageTooLargeError``, is ``file undecodable``); anything else a
  ``load`` raises is ``load failed``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ipc.wire import LOAD_FAILED, MEMBER_MISSING, SKIP_KINDS


class MemberMissing(ValueError):
    """A sample lacks a required ``member`` (a tar member's name or a column's): a skip under
    ``on_error="skip"``, of the kind ``member missing``."""

    skip_kind = MEMBER_MISSING

    def __init__(self, message: str, member: str = "") -> None:
        super().__init__(message)
        self.member = member

    def __reduce__(self) -> Any:
        return (type(self), (str(self), self.member))


class SampleLeftOut(ValueError):
    """A planned sample of ``shard`` lies past the ``whole`` samples the shard still holds (it
    was cut short since it was indexed): left out, with the shard's line in
    ``stats().left_out`` (:attr:`line`)."""

    def __init__(self, message: str, shard: str = "", whole: int = 0) -> None:
        super().__init__(message)
        self.shard, self.whole = shard, whole

    def __reduce__(self) -> Any:
        return (type(self), (str(self), self.shard, self.whole))

    @property
    def line(self) -> str:
        return (
            f"{self.shard} was truncated since it was indexed: its first {self.whole} samples "
            "are read; the rest of it is left out"
        )


@dataclass(frozen=True, slots=True)
class LoadSkip:
    """A sample whose ``load`` raised under ``on_error="skip"``: its id, the reason (the
    error's words), its kind (:data:`ipc.wire.SKIP_KINDS`), the member missing and, for a
    sample left out of a shard cut short, the shard's ``stats().left_out`` line."""

    index: int
    reason: str
    kind: str = LOAD_FAILED
    member: str = ""
    left_out: str = ""


def load_skip(index: int, error: BaseException) -> LoadSkip:
    """The skip of sample ``index`` whose ``load`` raised ``error``."""
    reason = f"load raised {type(error).__name__}: {error}"[:300]
    if isinstance(error, MemberMissing):
        return LoadSkip(index, reason, MEMBER_MISSING, error.member)
    if isinstance(error, SampleLeftOut):
        return LoadSkip(index, reason, LOAD_FAILED, left_out=error.line)
    kind = getattr(type(error), "skip_kind", LOAD_FAILED)
    return LoadSkip(index, reason, kind if kind in SKIP_KINDS else LOAD_FAILED)
