"""Workers played by threads of this process: the worker's side of the wire, answering the
trainer's commands as a worker process does, with real records over a real control channel and
real slots in memfd arenas. What the coordinator and the run do with them is what they do with
processes (the ``conftest`` checks none is started).

Each played worker's batch ``step`` of epoch ``e`` holds one output, ``id``: the sample ids
:func:`ids` gives. A worker has ``steps`` batches an epoch; a seek to a position starts it after
the batches that position says its shard received.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ipc import ChannelClosed, ControlChannel, SlotWriter, memfd_regions, wire
from ipc.wire import Position, Sampling

OUTPUTS = (wire.OutputSchema("id", "int64", 1, ""),)


def ids(shard: int, step: int, epoch: int, batch_size: int, steps: int) -> list[int]:
    """The sample ids of worker ``shard``'s batch ``step`` (counted from the epoch's start)."""
    first = (shard * steps + step) * batch_size
    return [epoch * 1000 + first + row for row in range(batch_size)]


class PlayedProcess:
    """What the engine reads of a worker's process: a sentinel that becomes readable when the
    played worker's thread ends, and its exit code."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        self.exitcode: int | None = None
        self.pid: int | None = None

    @property
    def sentinel(self) -> int:
        return self._read

    def exited(self, code: int) -> None:
        if self.exitcode is None:
            self.exitcode = code
            os.close(self._write)

    def join(self, timeout: float | None = None) -> None:
        pass

    def is_alive(self) -> bool:
        return self.exitcode is None

    def close(self) -> None:
        """Its sentinel goes (once the thread ended)."""
        if self._read >= 0:
            os.close(self._read)
            self._read = -1


@dataclasses.dataclass
class Script:
    """How every played worker of a pool behaves."""

    steps: int = 4
    batch_size: int = 2
    #: a Hello without sampling, as a source without positions says
    sampling: bool = True
    #: called with (worker, epoch, step) before each batch; returns False to die there
    before_batch: Callable[[int, int, int], bool] | None = None
    #: the workers never say Hello (a start that hangs)
    silent: bool = False


class PlayedWorker:
    """One worker's side: a thread that reads commands and sends records."""

    def __init__(self, index: int, spec: Any, script: Script, total: int) -> None:
        self.index = index
        self.spec = spec
        self.shard = spec.shard
        self.process = PlayedProcess()
        trainer, worker = _socketpair()
        self.channel = ControlChannel(trainer)  # (the trainer's end)
        self._end = ControlChannel(worker)
        self._script = script
        self._total = total
        self.exited = False
        self.pid: int | None = None
        self.oom_kills_at_start: dict[str, int] = {}
        self.commands: list[Any] = []  # every command the worker received, in order
        self._writer = SlotWriter(
            spec.num_slots,
            memfd_regions(f"played-{index}", f"worker {index}", spec.num_slots, None),
            self._end,
        )
        self._next_epoch = self.shard.epoch
        #: batches of the next epoch that the position it starts at says this shard received
        self._skip = _received(self.shard.position, self.shard.index)
        self._thread = threading.Thread(target=self._serve, name=f"played-{index}", daemon=True)

    # -------------------------------------------------------------- what the trainer reads
    def describe(self) -> str:
        return f"worker {self.index} ({self.shard.describe()}, played)"

    def mark_exited(self) -> None:
        self.exited = True

    def read_stack(self, wait_seconds: float) -> str:
        return ""

    def send(self, message: Any) -> bool:
        if self.exited or self.channel.closed:
            return False
        try:
            self.channel.send(message)
        except (ChannelClosed, OSError):
            return False
        return True

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """As the pool closes a worker: Shutdown, then its thread is joined and its ends
        closed."""
        self.send(wire.Shutdown())
        self._thread.join(10)
        assert not self._thread.is_alive(), f"played worker {self.index} did not stop"
        self.exited = True
        self.channel.close()
        self.process.close()

    # -------------------------------------------------------------- the worker's side
    def _serve(self) -> None:
        code = 0
        try:
            if self._script.silent:
                self._end.recv()  # until the trainer gives up (Shutdown or closed)
                return
            self._say_hello()
            while True:
                command = self._end.recv()
                if not self._obey(command):
                    return
        except ChannelClosed:
            pass
        except _Died:
            code = -9
        except BaseException:
            code = 1  # (a bug of the played worker: it dies, and pytest reports the error)
            raise
        finally:
            self._writer.close()
            self._end.close()
            self.process.exited(code)

    def _say_hello(self) -> None:
        script = self._script
        sampling = (
            Sampling(self._total, script.batch_size, 0, False, False, "played")
            if script.sampling
            else None
        )
        self._end.send(
            wire.Hello(
                os.getpid(),
                1,
                None,
                script.steps if script.sampling else None,
                sampling=sampling,
                first_epoch_steps=script.steps - self._skip,
            )
        )

    def _obey(self, command: Any) -> bool:
        """Handle one command; False at Shutdown."""
        self.commands.append(command)
        if isinstance(command, wire.Shutdown):
            return False
        if isinstance(command, wire.Release):
            for slot, generation in command.fills:
                self._writer.release(slot, generation)
        elif isinstance(command, wire.StartEpoch):
            self._run_epoch(command.epoch)
        elif isinstance(command, wire.AbortEpoch):
            self._next_epoch = command.epoch + 1
            self._end.send(wire.EpochAborted(command.epoch, True))
        elif isinstance(command, wire.Seek):
            self._seek(command.position)
        return True

    def _seek(self, position: Position) -> None:
        self._skip = _received(position, self.shard.index)
        self._next_epoch = position.epoch
        self._end.send(wire.Sought(position.epoch, self._script.steps - self._skip))

    def _run_epoch(self, epoch: int) -> None:
        script, skip = self._script, self._skip
        self._skip = 0
        self._end.send(
            wire.Signature(
                script.batch_size, "cpu", None, 1, OUTPUTS, "dict", True, True, "played", 0.01
            )
        )
        for step in range(script.steps - skip):
            if script.before_batch is not None and not script.before_batch(self.index, epoch, step):
                raise _Died
            if not self._publish(
                epoch, step, ids(self.index, skip + step, epoch, script.batch_size, script.steps)
            ):
                return  # aborted while waiting for a slot
        self._end.send(wire.EpochEnd(epoch, script.steps - skip, 1, 0))
        self._next_epoch = epoch + 1

    def _publish(self, epoch: int, step: int, values: list[int]) -> bool:
        slot = self._writer.acquire()
        while slot is None:  # every slot held by the trainer: wait for a release
            command = self._end.recv()
            self.commands.append(command)
            if isinstance(command, wire.Release):
                for held, generation in command.fills:
                    self._writer.release(held, generation)
            elif isinstance(command, wire.AbortEpoch):
                self._next_epoch = command.epoch + 1
                self._end.send(wire.EpochAborted(command.epoch, True))
                return False
            elif isinstance(command, wire.Shutdown):
                raise ChannelClosed
            slot = self._writer.acquire()
        data = np.asarray(values, dtype=np.int64).tobytes()
        region = self._writer.reserve(len(data))
        region.write(slot, 0, data)  # type: ignore[attr-defined]
        arena_id, generation = self._writer.publish(slot)
        placement = wire.OutputPlacement("id", "int64", 0, len(data), ((),) * len(values), True, "")
        self._end.send(
            wire.BatchReady(
                epoch, step, arena_id, slot, generation, (placement,), len(data), 0, 0, 1000
            )
        )
        return True


def _received(position: Position | None, index: int) -> int:
    """The batches ``position`` says shard ``index`` received (its last layout's count)."""
    if position is None or not position.segments:
        return 0
    _ranks, received = position.segments[-1]
    return received[index] if index < len(received) else 0


class _Died(Exception):
    """The played worker dies here (as a process killed by SIGKILL)."""


def _socketpair() -> tuple[Any, Any]:
    import socket

    return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)


class PlayedPool:
    """A :class:`~loader.processes.WorkerPool` whose workers are played by threads."""

    #: every pool made while a test patched the launcher's pool class, in order
    made: list[PlayedPool] = []

    def __init__(
        self, specs: Sequence[Any], start_method: str = "spawn", script: Script | None = None
    ) -> None:
        self._specs = list(specs)
        self.script = script or Script()
        self.handles: list[PlayedWorker] = []
        self.retired: list[PlayedWorker] = []
        self._closed = False
        PlayedPool.made.append(self)

    @property
    def closed(self) -> bool:
        return self._closed

    def _total(self) -> int:
        return len(self._specs) * self.script.steps * self.script.batch_size

    def start(self) -> None:
        for index, spec in enumerate(self._specs):
            worker = PlayedWorker(index, spec, self.script, self._total())
            self.handles.append(worker)
            worker.start()

    def replace(self, index: int, spec: Any) -> PlayedWorker:
        old = self.handles[index]
        old.stop()
        self.retired.append(old)
        worker = PlayedWorker(index, spec, self.script, self._total())
        self.handles[index] = worker
        worker.start()
        return worker

    def close(self, timeout: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        for worker in self.handles:
            worker.stop()
