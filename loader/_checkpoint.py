"""The loader's state: what ``state_dict()`` returns and what ``load_state_dict()`` accepts.

Runs in the trainer. A state is a small JSON-serialisable dict, O(shards): the epoch in progress,
what decides its samples (seed, batch size, dataset size, shuffle, drop_last), the layout it was
taken under, and per global shard the batches the trainer has *received* (handed to the user;
prefetched batches do not count). Earlier layouts of the same epoch (a run that was itself
resumed on another layout) are kept in ``history``. The arithmetic that turns a state into each
new shard's batches is :func:`workers.plan_epoch`, in the workers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

FORMAT = 1

#: Why a DALI reader (or a plain ExternalSource) cannot be resumed.
NOT_RESUMABLE = (
    "state_dict()/load_state_dict() need a source whose order the loader can recompute: "
    "sharded_files() (image files) or sharded_source() (any load(index)). This source is a DALI "
    "reader or a plain ExternalSource, and DALI capture mode cannot checkpoint a reader "
    "(execution-model rule 11)"
)


@dataclass(frozen=True)
class SamplingInfo:
    """What the workers' sources said decides each epoch's samples."""

    total: int
    batch_size: int
    seed: int
    shuffle: bool
    drop_last: bool


@dataclass(frozen=True)
class Resume:
    """A loaded state, as it applies to this loader."""

    epoch: int
    segments: tuple[tuple[int, tuple[int, ...]], ...]
    continues: bool  # same world size and workers: every shard goes on with its own batches

    def history(self) -> list[tuple[int, tuple[int, ...]]]:
        """Segments before this run's layout."""
        return list(self.segments[:-1] if self.continues else self.segments)

    def offsets(self, shard_indices: Sequence[int]) -> list[int]:
        """Batches each of this rank's shards had received before this run."""
        if not self.continues:
            return [0] * len(shard_indices)
        received = self.segments[-1][1]
        return [received[index] for index in shard_indices]


def make_state(
    *,
    sampling: SamplingInfo,
    epoch: int,
    world_size: int,
    num_workers: int,
    received: Sequence[int | None],
    history: Sequence[tuple[int, Sequence[int]]],
) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "seed": sampling.seed,
        "epoch": epoch,
        "batch_size": sampling.batch_size,
        "sampling": {
            "total": sampling.total,
            "shuffle": sampling.shuffle,
            "drop_last": sampling.drop_last,
        },
        "layout": {"world_size": world_size, "num_workers": num_workers},
        "received": list(received),
        "history": [[count, list(done)] for count, done in history],
    }


def parse_state(
    state: Any,
    *,
    sampling: SamplingInfo,
    world_size: int,
    num_workers: int,
    rank: int,
) -> Resume:
    """Check ``state`` against this loader; raise ``ValueError`` naming the field that does not
    apply. A change of layout (world size, workers) is never an error."""
    if not isinstance(state, Mapping):
        raise TypeError(f"load_state_dict() takes the dict state_dict() made, got {type(state)}")
    version = _field(state, "format", int)
    if version > FORMAT:
        raise ValueError(
            f"format: this state has format {version}, newer than this loader's {FORMAT}; "
            "upgrade dali-capture-loader"
        )
    if version < 1:
        raise ValueError(f"format: {version} is not a valid state format")
    for name, expected in (
        ("seed", sampling.seed),
        ("batch_size", sampling.batch_size),
    ):
        value = _field(state, name, int)
        if value != expected:
            raise ValueError(
                f"{name}: the state was taken with {name}={value}, this loader has {expected}; "
                f"build the Loader (and its source) with {name}={value} to resume it"
            )
    saved = _field(state, "sampling", Mapping)
    for name, expected_value in (
        ("total", sampling.total),
        ("shuffle", sampling.shuffle),
        ("drop_last", sampling.drop_last),
    ):
        value = saved.get(name)
        if value != expected_value:
            what = "dataset size" if name == "total" else name
            raise ValueError(
                f"sampling.{name}: the state was taken with {name}={value!r} ({what}), this "
                f"loader's source has {expected_value!r}; a state only applies to the same data"
            )
    epoch = _field(state, "epoch", int)
    if epoch < 0:
        raise ValueError(f"epoch: {epoch} is negative")
    layout = _field(state, "layout", Mapping)
    saved_world = layout.get("world_size")
    saved_workers = layout.get("num_workers")
    if (
        not (isinstance(saved_world, int) and isinstance(saved_workers, int))
        or min(saved_world, saved_workers) < 1
    ):
        raise ValueError(f"layout: {dict(layout)} is not a world size and a worker count")
    count = saved_world * saved_workers
    received = _field(state, "received", list)
    if len(received) != count:
        raise ValueError(f"received: {len(received)} counts for a layout of {count} shards")
    history: list[tuple[int, tuple[int, ...]]] = []
    for entry in _field(state, "history", list):
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2):
            raise ValueError(f"history: {entry!r} is not [num_shards, [received...]]")
        shards, done = entry
        if not isinstance(shards, int) or not isinstance(done, (list, tuple)):
            raise ValueError(f"history: {entry!r} is not [num_shards, [received...]]")
        if len(done) != shards or not all(isinstance(d, int) and d >= 0 for d in done):
            raise ValueError(f"history: {entry!r} needs {shards} counts >= 0")
        history.append((shards, tuple(done)))
    continues = (saved_world, saved_workers) == (world_size, num_workers)
    mine = range(rank * num_workers, (rank + 1) * num_workers)
    needed = mine if continues else range(count)
    missing = [index for index in needed if not isinstance(received[index], int)]
    if missing:
        raise ValueError(
            f"received: the counts of shards {missing} are missing: the state was taken without "
            "a torch.distributed group, so it describes one rank only. Resume it with the same "
            "world size and workers, or take states with the process group up"
        )
    if any(isinstance(r, int) and r < 0 for r in received):
        raise ValueError("received: a count is negative")
    filled = tuple(int(r) if isinstance(r, int) else 0 for r in received)
    return Resume(epoch, (*history, (count, filled)), continues)


def _field(state: Mapping[str, Any], name: str, kind: Any) -> Any:
    if name not in state:
        raise ValueError(f"{name}: the state has no {name!r}; pass what state_dict() returned")
    value = state[name]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise ValueError(f"{name}: {value!r} is not what state_dict() writes")
    return value


def merge_ranks(
    mine: Sequence[int],
    rank: int,
    num_workers: int,
    world_size: int,
    gathered: Sequence[Mapping[str, Any]] | None,
) -> list[int | None]:
    """The global per-shard counts: every rank's when gathered, else this rank's only."""
    received: list[int | None] = [None] * (world_size * num_workers)
    parts: Sequence[Mapping[str, Any]] = (
        gathered if gathered is not None else [{"rank": rank, "received": list(mine)}]
    )
    for part in parts:
        start = int(part["rank"]) * num_workers
        for offset, value in enumerate(part["received"]):
            received[start + offset] = value
    return received
