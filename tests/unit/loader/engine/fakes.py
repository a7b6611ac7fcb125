"""Plain stand-ins for what an engine policy reads of a worker's process, and helpers that build
sessions and records from them: no process, thread pool or DALI."""

from __future__ import annotations

from dataclasses import dataclass, field

from ipc import wire
from loader.engine._session import Idle, SessionView, Target, WorkerSession
from workers import Shard


def shard(index: int = 0, count: int = 2, epoch: int = 0) -> Shard:
    made = Shard.make(rank=0, world_size=1, worker=index, num_workers=count, seed=0)
    return made.for_epoch(epoch) if epoch else made


@dataclass(frozen=True)
class FakeSpec:
    """What healing replaces in a worker's spec (a dataclass, as ``WorkerSpec`` is)."""

    shard: Shard
    num_slots: int = 4
    bad_samples: frozenset[int] = frozenset()
    random: bytes = b""


class FakeProcess:
    def __init__(self, exitcode: int | None) -> None:
        self.exitcode = exitcode
        self.joined: list[float] = []

    def join(self, timeout: float) -> None:
        self.joined.append(timeout)


@dataclass(eq=False)
class FakeHandle:
    """A worker's process as the engine reads it; ``pid=None``: nothing is ever signalled.
    Compared by identity, as a real handle is."""

    index: int = 0
    shard: Shard = field(default_factory=shard)
    spec: FakeSpec = None  # type: ignore[assignment]
    pid: int | None = None
    exited: bool = False
    stack: str = ""
    exitcode: int | None = None
    oom_kills_at_start: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.spec is None:
            self.spec = FakeSpec(self.shard)
        self.process = FakeProcess(self.exitcode)

    def describe(self) -> str:
        return f"worker {self.index} ({self.shard.describe()}, pid {self.pid})"

    def read_stack(self, wait_seconds: float) -> str:
        return self.stack

    def mark_exited(self) -> None:
        self.exited = True


class FakeRegion:
    """A slot region that holds no memory (the reader only counts its slots)."""

    def __init__(self, num_slots: int, arena_id: int = 0) -> None:
        self.arena_id = arena_id
        self.num_slots = num_slots
        self.slot_size = 1 << 20
        self.closed = False

    def arrays(self, slot: int, outputs: object) -> tuple[list[object], object]:
        return [], None

    def released(self, slot: int) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def view(index: int = 0, target: Target | None = None, **fields: object) -> SessionView:
    """A snapshot of worker ``index`` (of 2), idle for epoch 0 unless told otherwise."""
    handle = fields.pop("handle", None) or FakeHandle(index, shard(index))
    assert isinstance(handle, FakeHandle)
    return SessionView(
        index,
        handle.shard,
        handle,  # type: ignore[arg-type]
        Idle(0) if target is None else target,
        **fields,  # type: ignore[arg-type]
    )


def batch(step: int, slot: int = 0, epoch: int = 0, **fields: object) -> wire.BatchReady:
    return wire.BatchReady(epoch, step, 0, slot, step + 1, (), 10, 0, 0, 0, **fields)  # type: ignore[arg-type]


def running(index: int = 0, count: int = 2, num_slots: int = 4, epoch: int = 0) -> WorkerSession:
    """A real session whose (fake) process is up and runs ``epoch``, with a slot region."""
    handle = FakeHandle(index, shard(index, count), FakeSpec(shard(index, count), num_slots))
    session = WorkerSession(handle)  # type: ignore[arg-type]
    session.attach(FakeRegion(num_slots))  # type: ignore[arg-type]
    session.go(Idle(epoch), up=True)
    session.start_epoch(epoch, 0)
    return session


def arrive(session: WorkerSession, count: int = 1) -> None:
    """``count`` more batches of its epoch arrive from ``session``'s worker, in fresh slots."""
    for _ in range(count):
        step = session.next_step
        assert session.on_batch(batch(step, slot=step % session.reader.num_slots))
