"""The loader's state: what ``state_dict()`` returns and what ``load_state_dict()`` accepts.

Runs in the trainer. A state is a small JSON-serialisable dict, O(shards): the epoch in progress,
what decides its samples (seed, batch size, dataset size and fingerprint, shuffle, drop_last), the
layout it was taken under, and per global shard the batches the trainer has *received* (handed to
the user; prefetched batches do not count) and the random generator states of its first batch not
received (``random``: DALI's state strings, the worker's default generator first; ``[]`` when the
worker's generators were as seeded for the epoch). Earlier layouts of the same epoch (a run that
was itself resumed on another layout) are kept in ``history``. The arithmetic that turns a state
into each new shard's batches is :func:`workers.plan_epoch`, in the workers.

Fields added to format 2 after it was first written (``random``, ``sampling.fingerprint``) may be
missing from a state: it still loads, and the loader logs what it then cannot guarantee. A format
2 state loads when it was taken at an epoch's start (nothing received); mid-epoch, its counts
are of another split of the epoch among workers, so it is refused with what to do.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ipc.wire import Position, RandomStates, Sampling, join_states, split_states
from workers import describe_difference

from ..config import LoaderConfig, distributed

logger = logging.getLogger("loader")

#: 3: a rank's batches are shared out whole among its workers (only a rank's last batch is
#: padded), and ``history`` names each earlier layout by its world size; format 2 split an epoch
#: into equal parts per worker. 2: epochs are ordered by a seeded bijection (O(shard) planning);
#: format 1's order differed.
FORMAT = 3

#: Why a DALI reader (or a plain ExternalSource) cannot be resumed.
NOT_RESUMABLE = (
    "state_dict()/load_state_dict() need a source whose order the loader can recompute: a "
    "dataset definition (FilesDataset, TarsDataset, SamplesDataset, MixDataset), or "
    "sharded_files() (image files) or sharded_source() (any load(index)). This source is a DALI "
    "reader or a plain ExternalSource, and DALI capture mode cannot checkpoint a reader "
    "(execution-model rule 11)"
)


@dataclass(frozen=True)
class Resume:
    """A loaded state, as it applies to this loader: the one resume position, and the batches
    this rank's trainer had received in the epoch before the save (as it counted them, over
    every earlier layout): ``len(loader)`` is that plus the batches left."""

    position: Position
    before: int = 0
    #: per shard of the saved layout, the random generator states of its first batch not
    #: received; None for a state saved without them (before they were added to format 2)
    random: tuple[RandomStates, ...] | None = None

    @property
    def epoch(self) -> int:
        return self.position.epoch

    @property
    def continues(self) -> bool:
        """Same world size and workers: every shard goes on with its own batches."""
        return self.position.continues

    def history(self) -> list[tuple[int, tuple[int, ...]]]:
        """Segments before this run's layout."""
        segments = self.position.segments
        return list(segments[:-1] if self.continues else segments)

    def random_states(self, shard_indices: Sequence[int]) -> list[RandomStates]:
        """Per shard of this rank, the random generator states its worker starts from: the
        saved ones on the same layout; on another layout (or without them) none, and each
        worker seeds its generators for the epoch."""
        if not self.continues or self.random is None:
            return [b""] * len(shard_indices)
        return [self.random[index] for index in shard_indices]

    def offsets(self, shard_indices: Sequence[int]) -> list[int]:
        """Batches each of this rank's shards had received before this run."""
        if not self.continues:
            return [0] * len(shard_indices)
        received = self.position.segments[-1][1]
        return [received[index] for index in shard_indices]

    def epoch_length(self, full: int, left: int) -> int:
        """``len(loader)`` in the resumed epoch: the batches received before plus ``left``.
        On another layout, at least a whole epoch of this layout (``full``): the saving ranks'
        count plus what is left can be shorter, and Lightning keeps the length it reads after a
        resume for every later epoch (it would cut them short) while it ends an epoch early at
        the iterator's end; the longer of the two loses nothing."""
        resumed = self.before + left
        return resumed if self.continues else max(full, resumed)

    def progress(
        self, shard_indices: Sequence[int], delivered: Sequence[int]
    ) -> tuple[list[int], list[tuple[int, tuple[int, ...]]], int]:
        """Where the resumed epoch stands after ``delivered`` more batches per shard of this
        rank: each shard's received count, the earlier layouts, this rank's batch count."""
        offsets = self.offsets(shard_indices)
        mine = [o + d for o, d in zip(offsets, delivered, strict=True)]
        return mine, self.history(), self.before + sum(delivered)

    def first_turn(
        self, shard_indices: Sequence[int], left: Sequence[int] | None = None
    ) -> tuple[list[int], int]:
        """Per shard of this rank, the epoch's step of its first batch in the resumed run, and
        the worker whose turn is first: round robin as if never interrupted, the first of those
        with batches ``left`` that received the fewest (a worker may have one batch more than
        another: one whose batches are all received has had its last turn)."""
        base = self.offsets(shard_indices)
        going = [w for w in range(len(base)) if left is None or left[w] > 0] or [0]
        fewest = min(base[w] for w in going)
        return base, next(w for w in going if base[w] == fewest)


def make_state(
    *,
    sampling: Sampling,
    epoch: int,
    world_size: int,
    num_workers: int,
    received: Sequence[int | None],
    history: Sequence[tuple[int, Sequence[int]]],
    steps: Sequence[int | None],
    random: Sequence[list[str] | None],
) -> dict[str, Any]:
    described: dict[str, Any] = {
        "total": sampling.total,
        "shuffle": sampling.shuffle,
        "drop_last": sampling.drop_last,
        "fingerprint": sampling.fingerprint,
    }
    if sampling.parts:
        described["parts"] = sampling.parts
    return {
        "format": FORMAT,
        "seed": sampling.seed,
        "epoch": epoch,
        "batch_size": sampling.batch_size,
        "sampling": described,
        "layout": {"world_size": world_size, "num_workers": num_workers},
        "received": list(received),
        "history": [[ranks, list(done)] for ranks, done in history],
        "steps": list(steps),
        "random": list(random),
    }


def encode_state(
    sampling: Sampling,
    config: LoaderConfig,
    resume: Resume,
    epoch: int,
    delivered: Sequence[int],
    random_states: Sequence[RandomStates],
) -> dict[str, Any]:
    """``state_dict()``: where this rank stands in ``epoch`` (``delivered`` batches per worker
    since ``resume``'s position, the random states of each worker's next batch), gathered
    across ranks (a collective when a process group is up) into the one global state."""
    shards = [shard.index for shard in config.shards]
    mine, history, steps = resume.progress(shards, delivered)
    random = [random_json(states) for states in random_states]
    gathered = distributed.gather(
        {"rank": config.rank, "received": mine, "epoch": epoch, "steps": steps, "random": random}
    )
    rank, workers, world = config.rank, config.num_workers, config.world_size
    return make_state(
        sampling=sampling,
        epoch=epoch,
        world_size=world,
        num_workers=workers,
        received=merge_ranks(mine, rank, workers, world, gathered),
        history=history,
        steps=rank_steps(steps, rank, world, gathered),
        random=merge_ranks(random, rank, workers, world, gathered, "random"),
    )


def random_json(states: RandomStates) -> list[str]:
    """A worker's random generator states as a state holds them (a list of DALI's strings)."""
    return split_states(states)


def parse_state(
    state: Any,
    *,
    sampling: Sampling,
    world_size: int,
    num_workers: int,
    rank: int,
    strict: bool = True,
) -> Resume:
    """Check ``state`` against this loader; raise ``ValueError`` naming the field that does not
    apply. A change of layout (world size, workers) is never an error. A dataset whose
    fingerprint differs is one; with ``strict=False`` it is logged as a warning instead."""
    version = _check_format(state)
    _check_sampling(state, sampling, strict)
    epoch = _field(state, "epoch", int)
    if epoch < 0:
        raise ValueError(f"epoch: {epoch} is negative")
    saved_world, saved_workers = _layout(state)
    count = saved_world * saved_workers
    received = _received(state, count)
    history = _history(state, sampling) if version > 2 else []
    continues = (saved_world, saved_workers) == (world_size, num_workers)
    mine = range(rank * num_workers, (rank + 1) * num_workers)
    needed = mine if continues else range(count)
    missing = [index for index in needed if received[index] is None]
    if missing:
        raise ValueError(
            f"received: the counts of shards {missing} are missing: the state was taken without "
            "a torch.distributed group, so it describes one rank only. Resume it with the same "
            "world size and workers, or take states with the process group up"
        )
    filled = tuple(0 if r is None else int(r) for r in received)
    _check_within("received", filled, saved_world, sampling, sampling.drop_last)
    steps = _steps(state, saved_world)
    before = _received_before(steps, filled, saved_world, saved_workers, rank, continues)
    random = _random(state, count, mine if continues else range(0))
    return Resume(Position(epoch, (*history, (saved_world, filled)), continues), before, random)


def _check_format(state: Any) -> int:
    """The state's format, when this loader can read it."""
    if not isinstance(state, Mapping):
        raise TypeError(f"load_state_dict() takes the dict state_dict() made, got {type(state)}")
    version: int = _field(state, "format", int)
    if version > FORMAT:
        raise ValueError(
            f"format: this state has format {version}, newer than this loader's {FORMAT}; "
            "upgrade dali-capture-loader"
        )
    if version == 1:
        raise ValueError(
            "format: this state has format 1, from a loader before 0.2 whose order of samples "
            "differs from this one's, so it cannot say which samples are left; finish that run "
            "with the version that saved it, or start the epoch again (drop the loader's state)"
        )
    if version < 1:
        raise ValueError(f"format: {version} is not a valid state format")
    if version == 2 and not _at_epoch_start(state):
        raise ValueError(
            "format: this state has format 2, from a loader before 0.3 that split an epoch into "
            "equal parts per worker (0.3 shares a rank's batches out whole, padding only its "
            "last batch), so its counts of batches received do not say which samples are left "
            "here; finish that epoch with the version that saved it, or start the epoch again "
            "(drop the loader's state)"
        )
    return version


def _received(state: Mapping[str, Any], count: int) -> list[int | None]:
    """The saved counts of batches received per shard (None: a rank the state does not
    describe)."""
    received: list[int | None] = _field(state, "received", list)
    if len(received) != count:
        raise ValueError(f"received: {len(received)} counts for a layout of {count} shards")
    for index, value in enumerate(received):
        if value is not None and not _is_count(value):
            raise ValueError(
                f"received[{index}]: {value!r} is not a count of batches (a whole number >= 0, "
                "or null for a rank the state does not describe)"
            )
    return received


def _at_epoch_start(state: Mapping[str, Any]) -> bool:
    """Nothing received in the saved epoch (a state taken between two epochs)."""
    received = state.get("received")
    return (
        not state.get("history")
        and isinstance(received, list)
        and all(r is None or r == 0 for r in received)
    )


def _check_sampling(state: Mapping[str, Any], sampling: Sampling, strict: bool) -> None:
    """The state's seed, batch size, dataset and sampling must be this loader's."""
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
    _check_dataset(state, sampling, strict)
    saved = _field(state, "sampling", Mapping)
    for name, expected_value in (
        ("total", sampling.total),
        ("shuffle", sampling.shuffle),
        ("drop_last", sampling.drop_last),
    ):
        value = saved.get(name)
        if value != expected_value:
            what = "dataset size" if name == "total" else name
            differs = _parts_differ(saved, sampling) if name == "total" else None
            raise ValueError(
                f"sampling.{name}: the state was taken with {name}={value!r} ({what}), this "
                f"loader's source has {expected_value!r}"
                + (f" ({differs})" if differs else "")
                + "; a state only applies to the same data"
            )


def _check_dataset(state: Mapping[str, Any], sampling: Sampling, strict: bool) -> None:
    """The state's dataset fingerprint must be this loader's: ``ValueError`` (a warning with
    ``strict=False``) naming both when they differ. Not checked when either side has none."""
    saved = _field(state, "sampling", Mapping).get("fingerprint")
    mine = sampling.fingerprint
    if not saved or not mine:
        if mine:
            logger.info(
                "the state has no dataset fingerprint (saved before it was added, or over a "
                "source without one): it cannot be checked to be of this loader's data"
            )
        return
    if not isinstance(saved, str):
        raise ValueError(f"sampling.fingerprint: {saved!r} is not what state_dict() writes")
    if saved == mine or _window_differs(saved, mine, state, sampling):
        return
    if saved.startswith("mix:") and mine == "mix2:" + saved.removeprefix("mix:"):
        _older_mix(state)
        return
    saved_total = _field(state, "sampling", Mapping).get("total")
    before = saved_total if isinstance(saved_total, int) else sampling.total
    message = (
        f"dataset: the state was saved over {describe_dataset(saved, before)}, this loader "
        f"reads {describe_dataset(mine, sampling.total)}"
    )
    differs = _parts_differ(_field(state, "sampling", Mapping), sampling)
    if differs:
        message += f" ({differs})"
    if isinstance(saved_total, int) and saved_total != sampling.total:
        # (strict=False would not help: the positions of another number of samples are others)
        epoch = state.get("epoch")
        raise ValueError(
            f"{message}; a state only applies to the same data, and one over "
            f"{saved_total} samples cannot resume over {sampling.total} (strict=False does not "
            "lift this). Resume over the files as they were, or start the state's epoch "
            f"afresh over these: set_epoch({epoch if isinstance(epoch, int) else 'e'}) instead "
            "of loading the state"
        )
    if strict:
        raise ValueError(
            f"{message}; a state only applies to the same data (pass strict=False to "
            "load_state_dict() to resume over a dataset you changed knowingly)"
        )
    logger.warning("%s; resuming anyway (strict=False)", message)


def _older_mix(state: Mapping[str, Any]) -> None:
    """A state over the same mix saved by 0.3 (``mix:``), whose sources' later permutations
    were not kept apart from the ones before (:mod:`workers.sources._separated`): between
    epochs it applies (the next epoch is drawn in this loader's order); taken mid-epoch, the
    samples it owes are others than the ones this order gives: ``ValueError``."""
    received = state.get("received")
    if isinstance(received, list) and not any(received):
        return
    epoch = state.get("epoch")
    raise ValueError(
        "dataset: the state was saved mid-epoch over this mix by a loader before 0.4, whose "
        "sources draw their later permutations in another order (since 0.4 a permutation's "
        "first samples are kept apart from the last ones before it, so that no batch holds a "
        "sample twice): the samples it still owes are not this loader's. Finish that epoch "
        "with the loader that saved it and save again at its end, or start its epoch afresh "
        f"here: set_epoch({epoch if isinstance(epoch, int) else 'e'}) instead of loading it"
    )


#: How a shuffling tar or Parquet source's fingerprint names its ``shuffle_window``.
_WINDOW = re.compile(r"\+window(\d+)")


def _window_differs(saved: str, mine: str, state: Mapping[str, Any], sampling: Sampling) -> bool:
    """Fingerprints of the same data that differ in their sources' ``shuffle_window`` only:
    ``ValueError`` naming the windows, also with ``strict=False`` (the window orders the epoch:
    another one would deliver other samples than those the state still owes). True (checked:
    :func:`_check_sampling` names the difference) where one side does not shuffle; False where
    more than the window differs."""
    if _WINDOW.sub("", saved) != _WINDOW.sub("", mine):
        return False
    if _field(state, "sampling", Mapping).get("shuffle") != sampling.shuffle:
        return True
    before, now = _WINDOW.findall(saved), _WINDOW.findall(mine)
    if len(before) != len(now):  # (a part of a mixture that shuffles on one side only)
        return False
    windows = [(int(a), int(b)) for a, b in zip(before, now, strict=True) if a != b]
    said = ", ".join(f"shuffle_window={a} (this loader's source has {b})" for a, b in windows)
    first = windows[0][0]
    raise ValueError(
        f"shuffle_window: the state was taken with {said}; the window orders the epoch, so "
        f"another one would deliver other samples than those the state owes (strict=False does "
        f"not lift this). Build the source with shuffle_window={first} to resume this state"
    )


def _parts_differ(saved: Mapping[str, Any], sampling: Sampling) -> str | None:
    """What differs between the parts the state recorded and this loader's (None: unknown)."""
    parts = saved.get("parts")
    if not isinstance(parts, str) or not parts or not sampling.parts:
        return None
    return describe_difference(parts, sampling.parts)


def describe_dataset(fingerprint: str, total: int) -> str:
    """How a dataset fingerprint is named in messages: ``files:<hash>`` (``sharded_files``)
    is a list of files, anything else the ``fingerprint=`` given to ``sharded_source``."""
    if fingerprint.startswith("files:"):
        return f"{total} files whose list hashes to {fingerprint.removeprefix('files:')}"
    return f"{total} samples of a source with fingerprint {fingerprint!r}"


def _random(
    state: Mapping[str, Any], count: int, mine: Sequence[int]
) -> tuple[RandomStates, ...] | None:
    """Per saved shard, the random generator states (None: the state has none). The shards of
    ``mine`` (this rank's on the same layout) must have them."""
    if "random" not in state:
        return None
    saved = _field(state, "random", list)
    if len(saved) != count:
        raise ValueError(f"random: {len(saved)} entries for a layout of {count} shards")
    random: list[RandomStates] = []
    for index, entry in enumerate(saved):
        try:
            if entry is None:
                if index in mine:
                    raise ValueError("missing")
                random.append(b"")
            elif isinstance(entry, list) and all(isinstance(word, str) for word in entry):
                random.append(join_states(entry))
            else:
                raise ValueError("not a list of strings")
        except ValueError:
            raise ValueError(
                f"random[{index}]: {entry!r} is not the list of random generator states "
                "state_dict() writes"
            ) from None
    return tuple(random)


def _layout(state: Mapping[str, Any]) -> tuple[int, int]:
    """The saved world size and workers per rank."""
    layout = _field(state, "layout", Mapping)
    saved_world = layout.get("world_size")
    saved_workers = layout.get("num_workers")
    if (
        not (isinstance(saved_world, int) and isinstance(saved_workers, int))
        or min(saved_world, saved_workers) < 1
    ):
        raise ValueError(f"layout: {dict(layout)} is not a world size and a worker count")
    return saved_world, saved_workers


def _history(state: Mapping[str, Any], sampling: Sampling) -> list[tuple[int, tuple[int, ...]]]:
    """Earlier layouts of the saved epoch, oldest first: ``[world_size, [received...]]``."""
    history: list[tuple[int, tuple[int, ...]]] = []
    shape = "[world_size, [received per shard...]]"
    for entry in _field(state, "history", list):
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2):
            raise ValueError(f"history: {entry!r} is not {shape}")
        ranks, done = entry
        if not _is_count(ranks) or ranks < 1 or not isinstance(done, (list, tuple)):
            raise ValueError(f"history: {entry!r} is not {shape}")
        if not done or len(done) % ranks or not all(_is_count(d) for d in done):
            raise ValueError(
                f"history: {entry!r} needs whole counts >= 0, the same number per rank of {ranks}"
            )
        # a resharded layout splits what was left: at most the batches of a whole epoch
        _check_within(f"history {entry!r}", done, ranks, sampling, False)
        history.append((ranks, tuple(done)))
    return history


def _steps(state: Mapping[str, Any], saved_world: int) -> list[int | None] | None:
    """Per saved rank, the batches its trainer received (None in a state without them)."""
    steps = state.get("steps")
    if steps is not None and (
        not isinstance(steps, list)
        or len(steps) != saved_world
        or not all(s is None or _is_count(s) for s in steps)
    ):
        raise ValueError(
            f"steps: {steps!r} is not one count of batches (or null) per rank of the saved "
            f"world size {saved_world}"
        )
    return steps


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_within(
    what: str, counts: Sequence[int], ranks: int, sampling: Sampling, drop_last: bool
) -> None:
    """No shard can have received more batches than its epoch has."""
    from workers import every_shard_steps

    shards = len(counts)
    most = every_shard_steps(sampling.total, shards, sampling.batch_size, drop_last, ranks)
    beyond = [index for index, value in enumerate(counts) if value > most[index]]
    if beyond:
        index = beyond[0]
        raise ValueError(
            f"{what}: shard {index} of {shards} (on {ranks} rank(s)) received {counts[index]} "
            f"batches, but an epoch of {sampling.total} samples in batches of "
            f"{sampling.batch_size} has {most[index]} for it; this state is not of this data "
            "(or was edited)"
        )


def _received_before(
    steps: Sequence[int | None] | None,
    received: Sequence[int],
    world_size: int,
    num_workers: int,
    rank: int,
    continues: bool,
) -> int:
    """Batches this rank's trainer had received in the saved epoch: on the same layout its own
    count; on another layout the saving ranks' count (equal on every rank, as each rank takes
    the same number of steps), so that ``len - before`` is what the new layout has left."""
    if steps is not None:
        own = steps[rank] if rank < len(steps) else None
        if continues and own is not None:
            return int(own)
        known = [int(s) for s in steps if s is not None]
        if known:
            return max(known)
    # a state without "steps" (format 1 before it was added): the last layout's counts
    per_rank = [sum(received[r * num_workers : (r + 1) * num_workers]) for r in range(world_size)]
    return per_rank[rank] if continues else max(per_rank)


def _field(state: Mapping[str, Any], name: str, kind: Any) -> Any:
    if name not in state:
        raise ValueError(f"{name}: the state has no {name!r}; pass what state_dict() returned")
    value = state[name]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise ValueError(f"{name}: {value!r} is not what state_dict() writes")
    return value


def merge_ranks(
    mine: Sequence[Any],
    rank: int,
    num_workers: int,
    world_size: int,
    gathered: Sequence[Mapping[str, Any]] | None,
    key: str = "received",
) -> list[Any]:
    """A global per-shard list (``key`` of each rank's part: the counts, the random states):
    every rank's when gathered, else this rank's only (None for the other ranks' shards)."""
    merged: list[Any] = [None] * (world_size * num_workers)
    parts: Sequence[Mapping[str, Any]] = (
        gathered if gathered is not None else [{"rank": rank, key: list(mine)}]
    )
    for part in parts:
        start = int(part["rank"]) * num_workers
        for offset, value in enumerate(part[key]):
            merged[start + offset] = value
    return merged


def rank_steps(
    steps: int, rank: int, world_size: int, gathered: Sequence[Mapping[str, Any]] | None
) -> list[int | None]:
    """Per rank, the batches its trainer received in the epoch (every rank's when gathered,
    else this rank's only); the ranks must be in the same epoch."""
    if gathered is not None:
        epochs = {part["epoch"] for part in gathered}
        if len(epochs) > 1:
            raise RuntimeError(
                f"ranks are in different epochs ({sorted(epochs)}): call state_dict() on "
                "every rank at the same step"
            )
    counts: list[int | None] = [None] * world_size
    for part in gathered or [{"rank": rank, "steps": steps}]:
        counts[int(part["rank"])] = int(part["steps"])
    return counts
