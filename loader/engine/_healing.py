"""Healing: when a worker's process is replaced, where its replacement starts, which samples
are skipped, and how long the trainer waits for a worker. Runs in the trainer.

:class:`Healing` holds the restart budget, the registry of samples that fail (``on_error=
"skip"``) and the skip limit. It answers with decisions -- :class:`Replace` (a new process, its
spec and what it does once up) or :class:`Fail` (the error to raise) -- and never sends, spawns
or raises itself; the coordinator's wait (:mod:`loader.engine._waiting`) acts on them.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

from ipc import wire
from ipc.wire import Position
from workers import WorkerSpec, continue_from

from ..config import LoaderConfig
from ..errors import SkipLimitError
from ..processes import WorkerHandle
from ._session import Aborting, Idle, Running, Seeking, SessionView, Stopped, Target

logger = logging.getLogger("loader")

#: Samples skipped for one reason that are each logged at WARNING (a damaged row group's rows
#: all fail for the same one: its thousand lines said nothing more than the first few)
SAID_EACH = 5

#: With ``timeout`` set, the longest a replacement process may take to start (spawn, imports,
#: sources) before its Hello, unless ``startup_timeout`` or ``timeout`` says otherwise.
REPLACEMENT_START = 60.0


@dataclass(frozen=True, slots=True)
class Replace:
    """Start a new process for the worker with ``spec``; once up it does ``target``; its step 0
    is the epoch's ``first_step``. ``budgeted``: it counts against ``max_restarts``."""

    spec: WorkerSpec
    target: Target
    first_step: int
    budgeted: bool


@dataclass(frozen=True, slots=True)
class Fail:
    error: BaseException


@dataclass(frozen=True, slots=True)
class Timeouts:
    """``timeout``: per batch once a worker's loop runs (None: wait forever); ``trace``: for a
    worker's traced first batch and after a rebuild; ``startup``: a process's start."""

    timeout: float | None
    trace: float | None
    startup: float


class Healing:
    """The restart budget, the failing samples, and the limits of each wait."""

    def __init__(
        self, *, max_restarts: int, on_error: str, max_skipped: int | None, timeouts: Timeouts
    ) -> None:
        self.max_restarts = max_restarts
        self.on_error = on_error
        self.max_skipped = max_skipped
        self.timeouts = timeouts
        self.restarts = 0
        self.bad_samples: set[int] = set()  # on_error="skip": samples that fail inside DALI
        self.skipped: dict[int, str] = {}  # sample id -> name, every sample skipped so far
        #: sample id -> (its kind of failure, the member missing), as its finder reported it
        self.reasons: dict[int, tuple[str, str]] = {}
        #: samples left out of a shard found cut short since it was indexed (data known lost,
        #: not counted against ``max_skipped``)
        self.lost: set[int] = set()
        self._epoch_skips: tuple[int, list[tuple[int, str]]] = (0, [])  # (epoch, its skips)
        #: line -> itself, in ``stats().left_out``: shards found cut short by a read (where a
        #: start's listing would have found them: the line a worker's hello gives then)
        self.left_out: dict[str, str] = {}
        self._exiting: set[int] = set()  # workers that said they exit (SamplesFailed)
        #: samples logged per reason (past :data:`SAID_EACH`, one line says the rest go unlogged)
        self._said: dict[str, int] = {}
        #: worker -> its replacement process, and the traces counted before it started
        self._replacements: dict[int, tuple[WorkerHandle, int]] = {}

    # ------------------------------------------------------------------------ samples
    def samples_failed(
        self, view: SessionView, message: wire.SamplesFailed
    ) -> wire.BadSamples | None:
        """on_error="skip": remember the samples; returns what to tell the other workers (each
        would otherwise fail on them in a later epoch, and be replaced for it, or log them
        again). The worker's exit that follows is expected, unless it goes on (``exits=False``:
        their ``load`` raised, or hung). Each sample is logged once, by whoever reported it."""
        new = [
            (index, name)
            for index, name in zip(message.ids, message.names, strict=True)
            if index not in self.bad_samples
        ]
        # the step counted in this process's epoch (a replacement's, or a resumed one's, starts
        # at 0); a batch of the next epoch (prefetched across the epoch's end) counts from 0
        step = view.step_of(message.epoch, message.step)
        for index, name in new:
            described = f"sample {index}" if name == str(index) else f"sample {index} ({name})"
            said = self._said[message.reason] = self._said.get(message.reason, 0) + 1
            if said == SAID_EACH + 1:  # (a damaged row group: its every row, for one reason)
                logger.warning(
                    "more samples fail for the same reason (%s): skipped without a line each "
                    "(stats().skipped names them all)",
                    message.reason,
                )
            logger.log(
                logging.WARNING if said <= SAID_EACH else logging.DEBUG,
                "skipped %s: worker %d (%s) fails on it at epoch %d, its own step %d (%s)",
                described,
                view.index,
                view.shard.describe(),
                message.epoch,
                step,
                message.reason,
            )
        for index in message.ids:
            self.reasons.setdefault(index, (message.kind, message.member))
        if message.left_out:
            self.lost.update(message.ids)
            self.left_out.setdefault(message.left_out, message.left_out)
        self.bad_samples.update(message.ids)
        if message.exits:
            self._exiting.add(view.index)
        return wire.BadSamples(tuple(index for index, _ in new)) if new else None

    def delivered(self, info: wire.BatchReady, total: int) -> SkipLimitError | None:
        """Count a delivered batch's skipped samples; more than ``max_skipped`` in an epoch is
        the error to raise, naming each of them by the kind of failure that made it a skip.
        Samples left out of a shard found truncated since it was indexed are not counted (the
        warning that named the shard accounts for them, as for a shard listed damaged)."""
        for index, name in zip(info.skipped, info.skipped_names, strict=True):
            self.skipped.setdefault(index, name)
        epoch, skips = self._epoch_skips
        if epoch != info.epoch:
            skips = []
        skips.extend(
            (index, name)
            for index, name in zip(info.skipped, info.skipped_names, strict=True)
            if index not in self.lost
        )
        self._epoch_skips = (info.epoch, skips)
        limit = self.max_skipped
        default = limit is None
        if limit is None:  # by default 1% of an epoch's samples (at least 8)
            limit = max(8, math.ceil(0.01 * total))
        if len(skips) <= limit:
            return None
        return SkipLimitError(self._limit_message(info.epoch, skips, limit, default))

    def _limit_message(
        self, epoch: int, skips: list[tuple[int, str]], limit: int, default: bool
    ) -> str:
        """The skip-limit error's words: the count, each skip by its kind, what to do."""
        kinds: dict[str, list[str]] = {}
        members: set[str] = set()
        for index, name in skips:
            kind, member = self.reasons.get(index, (wire.LOAD_FAILED, ""))
            kinds.setdefault(kind, []).append(name)
            if member:
                members.add(member)
        lines = [
            f"{len(skips)} samples were skipped in epoch {epoch}, more than max_skipped={limit}"
            + (" (the default: 1% of an epoch's samples, at least 8)" if default else "")
            + ":"
        ]
        for kind in wire.SKIP_KINDS:
            names = kinds.get(kind)
            if names:
                shown = ", ".join(names[:5]) + (
                    f" and {len(names) - 5} more" if len(names) > 5 else ""
                )
                lines.append(f"  {len(names)} {kind}: {shown}")
        lines.append("What to do:")
        if "member missing" in kinds:
            example = ", ".join(f"{m!r}: b''" for m in sorted(members)) or "'txt': b''"
            lines.append(
                "  member missing: if samples may lack it, make it optional "
                f"(optional={{{example}}} on TarsDataset/sharded_tars, or for a column on "
                "ParquetDataset/sharded_parquet): such a sample then gets the default, "
                "counted in stats().defaulted, not skipped"
            )
        if "file undecodable" in kinds:
            lines.append(
                "  file undecodable: the file is damaged or not what the decoder reads; replace or"
                " remove it in the data"
            )
        if "exception in step" in kinds:
            lines.append(
                "  exception in step: step() raised on these samples alone; fix step() for them"
            )
        if "load failed" in kinds:
            lines.append("  load failed: the sample cannot be read; fix or remove it in the data")
        lines.append(
            "  or, if this many skips are expected, raise max_skipped= (None: 1% of an epoch, "
            "at least 8)"
        )
        return "\n".join(lines)

    # ------------------------------------------------------------------------ restarts
    def decide(
        self, view: SessionView, error: BaseException, cause: str
    ) -> tuple[Replace | Fail, wire.BadSamples | None]:
        """A dead or stuck worker: replace it when allowed, else fail with ``error`` (saying
        why not). Also returns what to tell the other workers of a sample whose load hangs."""
        if view.index in self._exiting:
            self._exiting.discard(view.index)
            return self._replace(view, "skipped samples that fail inside DALI", False), None
        reason = self._no_restart_reason(view)
        if reason is not None:
            if reason:
                error.args = (f"{error.args[0]} ({reason})", *error.args[1:])
            return Fail(error), None
        found = None
        hung: wire.LoadRunning | None = getattr(error, "hung_load", None)
        if hung is not None and self.on_error == "skip":
            # a sample whose load hangs is skipped like one whose load raises: logged once, the
            # other workers told, and the replacement (the stuck process is killed) makes its
            # batch without it
            found = self.samples_failed(
                view,
                wire.SamplesFailed(
                    hung.epoch,
                    hung.step,
                    (hung.index,),
                    (hung.name,),
                    f"its load() hangs: still running after {hung.seconds:.1f} s",
                    exits=False,
                    kind=wire.LOAD_FAILED,
                ),
            )
        return self._replace(view, cause, True), found

    def _no_restart_reason(self, view: SessionView) -> str | None:
        if self.max_restarts == 0:
            return ""  # the default: fail fast, with the plain message
        if self.restarts >= self.max_restarts:
            return f"no restart: the restart budget (max_restarts={self.max_restarts}) is spent"
        if view.hello is None:
            return "no restart: the worker never started, so its source is unknown"
        if view.hello.sampling is None:
            return (
                "no restart: the source cannot start mid-shard (a DALI reader or a plain "
                "ExternalSource); pass a dataset definition (FilesDataset, SamplesDataset...) "
                "or use sharded_files() or sharded_source() to heal"
            )
        if isinstance(view.target, Stopped):
            return "no restart: the loader is closing"
        return None

    def _replace(self, view: SessionView, cause: str, budgeted: bool) -> Replace:
        """A new process for ``view``'s shard, starting at the first batch the trainer has
        not received; batches the old one published and the trainer did not hand out are
        dropped (the new process makes them again), so every sample still arrives once, in
        the same order."""
        if budgeted:
            self.restarts += 1
        target, shard = view.target, view.shard
        first = view.first_step
        new: Target
        position: Position | None
        # a worker that ended its epoch but whose batches the trainer has not all handed out
        # is replaced like a running one: the new process makes the rest of them again
        if isinstance(target, Running) and (not target.ended or view.queued):
            new = Running(target.epoch, target.start)
            epoch = target.epoch
            position = continue_from(
                target.start,
                epoch,
                shard.count,
                shard.index,
                view.delivered,
                ranks=shard.world_size,
            )
            first = view.undelivered_step
            where = f"goes on at batch {first} of epoch {epoch}"
        elif isinstance(target, Seeking):
            new = Seeking(target.position, sent=False)
            epoch, position = target.position.epoch, target.position
            where = f"resumes epoch {epoch}"
        else:  # idle between epochs
            if isinstance(target, Idle):
                new = target
            else:
                assert isinstance(target, (Running, Aborting))
                new = Idle(target.epoch + 1)
            epoch, position = new.epoch, new.position
            where = f"is ready for epoch {epoch}"
        if budgeted:
            logger.warning(
                "worker %d (%s) %s; replaced it with a new process (restart %d of "
                "max_restarts=%d), which %s",
                view.index,
                shard.describe(),
                cause,
                self.restarts,
                self.max_restarts,
                where,
            )
        else:  # a DALI error leaves a process unable to trace again: a fresh one goes on
            logger.info(
                "worker %d (%s) %s; a new process %s", view.index, shard.describe(), cause, where
            )
        spec = dataclasses.replace(
            view.handle.spec,
            shard=shard.for_epoch(epoch, position),
            bad_samples=frozenset(self.bad_samples),
            random=view.random,  # those of the first batch it makes: the same bytes again
        )
        return Replace(spec, new, first, budgeted)

    def started(self, view: SessionView) -> None:
        """``view``'s worker has a replacement process (its first trace is bounded apart)."""
        self._replacements[view.index] = (view.handle, len(view.counters.trace_seconds))

    # ------------------------------------------------------------------------ waits
    def wait_limit(self, view: SessionView) -> tuple[float | None, str]:
        """How long the trainer waits for ``view``'s next record, and the setting it comes
        from (for messages): ``startup_timeout`` while a process starts or traces its first
        batch, else ``timeout``.

        A replacement (``timeout`` set) must not wait ``startup_timeout`` (300 s by default) for
        a worker that hangs again, e.g. on the same sample: its start (spawn, imports, sources;
        nothing loaded yet) gets :data:`REPLACEMENT_START` at most, and its traced first batch
        ``timeout`` plus twice the longest trace this worker took before (what tracing costs
        here, measured: a replacement traces the same loop again), so a hang is seen after
        about ``timeout`` per restart."""
        timeout, startup = self.timeouts.timeout, self.timeouts.startup
        starting = not view.up
        tracing = view.signature_pending and view.received == 0
        traced = view.counters.trace_seconds
        # a replacement process that has not traced yet (a later trace, after a rebuild, is
        # bounded like any worker's)
        replacement = self._replacements.get(view.index) == (view.handle, len(traced))
        if timeout is not None and replacement and (starting or tracing):
            if not starting and traced:
                extra = round(2 * max(traced), 1)
                return timeout + extra, (
                    f"timeout={timeout:g}, plus {extra:g} s for a replacement to trace again: "
                    "twice its first trace"
                )
            start = min(startup, max(timeout, REPLACEMENT_START))
            return start, f"a replacement's start: at most {start:g} s"
        if starting:
            return startup, f"startup_timeout={startup:g}"
        if tracing:
            limit = self.timeouts.trace
            return limit, "" if limit is None else f"startup_timeout={limit:g}"
        return timeout, "" if timeout is None else f"timeout={timeout:g}"


def check_healable(config: LoaderConfig, positional: bool) -> None:
    """on_error="skip" and max_restarts need a source that knows its sample ids (``positional``:
    a sharded_source/sharded_files root): ``ValueError`` for a skip, a warning for restarts."""
    if config.on_error == "skip" and not positional:
        raise ValueError(
            "on_error='skip' needs a source that knows its sample ids: a dataset definition "
            "(FilesDataset, TarsDataset, SamplesDataset, MixDataset), sharded_files() or "
            "sharded_source(); a DALI reader cannot leave a sample out (its pipeline is "
            "disabled by any error)"
        )
    if config.max_restarts and not positional:
        logger.warning(
            "max_restarts=%d, but the source is a DALI reader (or a plain ExternalSource), "
            "which cannot start mid-shard: a dead worker will raise, not be replaced. Pass a "
            "dataset definition (FilesDataset, SamplesDataset...) or use sharded_files() or "
            "sharded_source() to heal",
            config.max_restarts,
        )
