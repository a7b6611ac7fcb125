"""What one worker reads: its place among all workers of all ranks.

Runs in both processes: the trainer computes shards, the worker hands one to the user's
``source(shard)`` and ``feeders(shard)``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ipc.wire import Position


@dataclass(frozen=True, slots=True)
class Shard:
    """One worker's share of the data.

    ``index = rank * num_workers + worker`` and ``count = world_size * num_workers``: pass them to a
    DALI reader as ``shard_id`` and ``num_shards``. ``seed`` is the loader's seed plus ``index``, so
    every shard draws different random numbers and the same loader seed always gives the same ones.
    ``epoch`` is the epoch the sources are (re)built for: 0 at start, and the next epoch after the
    trainer broke out of one. ``position`` is set when the loader resumes ``epoch`` from a saved
    state: ``sharded_source`` then starts where that state stopped.
    """

    index: int
    count: int
    rank: int
    world_size: int
    worker: int
    num_workers: int
    seed: int
    epoch: int = 0
    position: Position | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in [0, world_size={self.world_size})")
        if not 0 <= self.worker < self.num_workers:
            raise ValueError(f"worker {self.worker} is not in [0, num_workers={self.num_workers})")
        if self.index != self.rank * self.num_workers + self.worker:
            raise ValueError("index must be rank * num_workers + worker")
        if self.count != self.world_size * self.num_workers:
            raise ValueError("count must be world_size * num_workers")

    @classmethod
    def make(cls, *, rank: int, world_size: int, worker: int, num_workers: int, seed: int) -> Shard:
        index = rank * num_workers + worker
        return cls(
            index=index,
            count=world_size * num_workers,
            rank=rank,
            world_size=world_size,
            worker=worker,
            num_workers=num_workers,
            seed=seed + index,
        )

    def for_epoch(self, epoch: int, position: Position | None = None) -> Shard:
        """This shard with sources for ``epoch`` (resumed from ``position``, if given)."""
        return replace(self, epoch=epoch, position=position)

    def describe(self) -> str:
        return f"shard {self.index}/{self.count}"
