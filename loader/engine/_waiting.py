"""The trainer's wait on every worker at once, and what it does with a dead or stuck one. Runs in
the trainer.

:class:`Waiter` waits on all control channels, all process sentinels and the release queue's
wakeup pipe at once (one ``select.poll``, rebuilt only when the set of live workers changes), so
a record, a dead worker or a released slot each wake it at once; there is no polling. It hands
every record to the router (:mod:`loader.engine._routing`), sends the releases that are due
around each wait, and acts on healing's decision (:mod:`loader.engine._healing`) for a worker
that died or sent nothing within the limit: it replaces the process or raises the error. It
counts the time spent blocked.

A wait only reports what happened; what to wait for, and for how long, is the coordinator's
(:mod:`loader.engine._coordinator`), whose wait fails the pool before anything raised here
leaves.
"""

from __future__ import annotations

import select
import time

from ..processes import WorkerPool
from . import _failures
from ._agreement import Agreement
from ._healing import Fail, Healing
from ._roster import Roster
from ._routing import Router
from ._session import WorkerSession

Limit = tuple[float | None, str]  # how long to wait, and the setting it comes from
_PollSet = tuple[select.poll, dict[int, WorkerSession], dict[int, WorkerSession]]


class Waiter:
    """One wait over every worker; replaces a worker that died or is stuck."""

    def __init__(
        self,
        roster: Roster,
        pool: WorkerPool,
        healing: Healing,
        router: Router,
        agreement: Agreement,
    ) -> None:
        self._roster = roster
        self._pool = pool
        self._healing = healing
        self._router = router
        self._agreement = agreement
        self.wait_ns = 0  # time spent blocked in the wait, over the pool's life
        #: True from just before the poll until it returned, before anything that arrived is
        #: handled: an exception a signal handler raised meanwhile (Ctrl-C) left every session
        #: as it was (:mod:`loader.engine._interrupts`). Cleared at the start of each wait.
        self.blocked = False
        self._poll_set: _PollSet | None = None
        self._poll_key: tuple[tuple[int, ...], tuple[int, ...]] | None = None

    def wait(self, wanted: WorkerSession, limit: Limit, startup: bool) -> None:
        """Wait until something arrives, then handle everything that did. When ``limit`` passes
        with nothing from anyone, ``wanted`` is stuck (healed or failed; at startup the caller
        decides)."""
        timeout, setting = limit
        queue = self._roster.releases.queue
        self.blocked = False
        with queue.trainer_waiting():  # from here, a finalizer on this thread wakes us
            # lazy: releases a worker does not need to go on are held back (see Releases.due)
            self._roster.send_releases(lazy=True)
            poller, channels, sentinels = self._poll_set_for_live_sessions()
            started = time.perf_counter_ns()
            self.blocked = True
            ready = poller.poll(None if timeout is None else max(0, int(timeout * 1000)))
            self.wait_ns += time.perf_counter_ns() - started
        self.blocked = False
        if not ready:
            if not startup:
                assert timeout is not None  # (a wait without a limit does not time out)
                self._heal(wanted, *_failures.timed_out(wanted.view(), timeout, setting))
            return
        died: list[WorkerSession] = []
        for fd, _events in ready:
            if fd in channels:
                self._router.drain(channels[fd])
            elif fd in sentinels:
                died.append(sentinels[fd])
            elif fd == queue.wakeup_fd:
                queue.clear_wakeup()
        for session in died:
            self._router.drain(session)  # a failure record sent just before exiting explains it
            self._heal(session, *_failures.died(session.view()))
        self._roster.send_releases(lazy=True)

    def _poll_set_for_live_sessions(self) -> _PollSet:
        """One ``select.poll`` over live channels, sentinels and the wakeup pipe, rebuilt only
        when the set of live workers changes (``multiprocessing.connection.wait`` would build a
        selector on every call). A channel at its end of stream is left out: the worker is gone
        or going, and its sentinel fires once the process has exited (no spinning on a
        readable end of stream)."""
        sessions = self._roster.sessions
        live = tuple(
            s.index for s in sessions if not s.handle.exited and not s.handle.channel.closed
        )
        at_eof = tuple(s.index for s in sessions if s.handle.channel.at_eof)
        if self._poll_set is None or self._poll_key != (live, at_eof):
            poller = select.poll()
            channels: dict[int, WorkerSession] = {}
            sentinels: dict[int, WorkerSession] = {}
            for index in live:
                session = sessions[index]
                if not session.handle.channel.at_eof:
                    channels[session.handle.channel.fileno()] = session
                sentinels[session.handle.process.sentinel] = session
            for fd in (*channels, *sentinels, self._roster.releases.queue.wakeup_fd):
                poller.register(fd, select.POLLIN)
            self._poll_set = (poller, channels, sentinels)
            self._poll_key = (live, at_eof)
        return self._poll_set

    def _heal(self, session: WorkerSession, error: BaseException, cause: str) -> None:
        """Replace ``session``'s worker when the healing policy allows; else raise ``error``."""
        decision, found = self._healing.decide(session.view(), error, cause)
        self._roster.tell_others(session, found)
        if isinstance(decision, Fail):
            raise decision.error
        if decision.budgeted:
            session.count_restart()
        session.drop_process()
        handle = self._pool.replace(session.index, decision.spec)
        session.replaced(handle, decision.target, decision.first_step)
        self._healing.started(session.view())
        self._agreement.reopen()
        self._poll_set = None  # the new process has its own channel and sentinel
