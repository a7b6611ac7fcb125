"""``assert_resumes_exactly``: a user's own pipeline, run whole and stopped, saved and resumed,
compared byte for byte. Runs in the trainer (the test process); re-exported by
:mod:`loader.testing`.

Three runs of ``make_loader()``'s loader: an uninterrupted one over ``epochs`` epochs; one stopped
after ``stop_after`` batches, whose ``state_dict()`` goes through JSON; and one (or one per rank of
another layout) that loads that state and runs to the end of the same epochs. On the same layout
every batch after the resume must equal the uninterrupted run's batch of the same epoch, step
and shard, every output byte for byte (the order of arrival between workers may differ with
``in_order=False``; batches are matched by where they come from). On another layout batches are
cut differently, so rows are matched by sample: ``key`` names an output that holds each row's
sample id, and every sample's row must be the same in both runs (padding and replaced rows
aside), each sample delivered once per epoch.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .._loader import Loader

#: (epoch, step of the shard, shard): where a batch comes from, the same in both runs on one
#: layout (``batch.info.worker_step``: the rank's step depends on the order of arrival with
#: ``in_order=False``)
Where = tuple[int, int, int]


@dataclass(frozen=True)
class Delivered:
    """One delivered batch, copied out of its slot."""

    epoch: int
    step: int
    shard: int
    padded: int
    replaced: tuple[int, ...]
    outputs: dict[str, Any]  # name -> numpy array (dense) or list of per-sample arrays

    @property
    def where(self) -> Where:
        return self.epoch, self.step, self.shard

    def describe(self) -> str:
        return f"epoch {self.epoch}, step {self.step} (shard {self.shard})"

    def rows(self, key: str) -> Iterator[tuple[int, int]]:
        """(row, sample id) of every row that holds a sample of its own (no padding, no
        repeat in place of a skipped sample)."""
        ids = self.outputs[key]
        for row in range(len(ids) - self.padded):
            if row not in self.replaced:
                yield row, int(np.asarray(ids[row]).reshape(-1)[0])


def assert_resumes_exactly(
    make_loader: Callable[..., Loader],
    *,
    stop_after: int,
    epochs: int = 2,
    layout: tuple[int, int] | None = None,
    key: str | None = None,
) -> None:
    """Fail (``AssertionError``) unless a run stopped after ``stop_after`` batches and resumed
    from its ``state_dict()`` delivers what an uninterrupted run does, over ``epochs`` epochs.

    ``make_loader(**overrides)`` builds the loader (a new one each call; it is closed here): with
    no arguments for the uninterrupted and the stopped run (one rank), and with ``rank=``,
    ``world_size=``, ``num_workers=`` for each rank of ``layout`` (``(world_size, num_workers)``)
    when the resume is on another layout. There batches differ, so ``key`` must name an output
    holding each row's sample id, and rows are compared sample by sample (bit-exact there only
    for randomness drawn from the sample id, e.g. ``np.random.default_rng([seed, epoch,
    index])`` in ``load``). The message names the first batch (epoch, step, shard) or sample that
    differs, the output, and the first differing row.
    """
    if stop_after < 0 or epochs < 1:
        raise ValueError(f"stop_after must be >= 0 and epochs >= 1, got {stop_after}, {epochs}")
    if layout is not None and key is None:
        raise ValueError(
            "a resume on another layout cuts other batches: pass key=, the output that holds "
            "each row's sample id, to compare sample by sample"
        )
    with make_loader() as loader:
        whole = _take(loader, epochs)
    with make_loader() as loader:
        before = _take(loader, epochs, stop_after)
        state = json.loads(json.dumps(loader.state_dict()))
    after: list[Delivered] = []
    if layout is None:
        with make_loader() as loader:
            loader.load_state_dict(state)
            after = _take(loader, epochs)
    else:
        world_size, num_workers = layout
        for rank in range(world_size):
            with make_loader(rank=rank, world_size=world_size, num_workers=num_workers) as loader:
                loader.load_state_dict(state)
                after += _take(loader, epochs)
    if key is None:
        _compare_batches(whole, before, after)
    else:
        _compare_samples(whole, before + after, key)


def _take(loader: Loader, epochs: int, limit: int | None = None) -> list[Delivered]:
    """Every batch up to the end of epoch ``epochs - 1`` (the first ``limit`` only)."""
    taken: list[Delivered] = []
    for _ in range(loader.epoch, epochs):
        if limit is not None and len(taken) >= limit:
            break  # (another iter() would leave the epoch in progress)
        iterator = iter(loader)
        while limit is None or len(taken) < limit:  # (a batch taken counts as received)
            batch = next(iterator, None)
            if batch is None:
                break
            taken.append(_copied(batch))
            del batch  # (its views hold a slot)
    return taken


def _copied(batch: Any) -> Delivered:
    info = batch.info
    if isinstance(batch, dict):
        named = dict(batch)
    elif isinstance(batch, tuple):
        named = {str(index): value for index, value in enumerate(batch)}
    else:
        named = {"0": batch}
    outputs = {name: _host(value) for name, value in named.items()}
    return Delivered(info.epoch, info.worker_step, info.shard, info.padded, info.replaced, outputs)


def _host(value: Any) -> Any:
    """A private numpy copy of an output (a list of them for a ragged one)."""
    if isinstance(value, list):
        return [_host(item) for item in value]
    if hasattr(value, "detach"):  # torch
        value = value.detach().cpu().numpy()
    elif hasattr(value, "get") and not isinstance(value, np.ndarray):  # cupy
        value = value.get()
    return np.array(value, copy=True)


def _compare_batches(
    whole: list[Delivered], before: list[Delivered], after: list[Delivered]
) -> None:
    expected = {batch.where: batch for batch in whole}
    got: dict[Where, Delivered] = {}
    for batch in before + after:
        if batch.where in got:
            raise AssertionError(f"the batch of {batch.describe()} was delivered twice")
        got[batch.where] = batch
    for where in sorted(expected, key=lambda w: (w[0], w[1], w[2])):
        if where not in got:
            raise AssertionError(
                f"the batch of {expected[where].describe()} was never delivered after the resume"
            )
        difference = _difference(expected[where], got[where])
        if difference is not None:
            raise AssertionError(
                f"the batch of {expected[where].describe()} differs from the uninterrupted "
                f"run's after a resume at batch {len(before)}: {difference}"
            )
    extra = sorted(set(got) - set(expected))
    if extra:
        raise AssertionError(f"batches the uninterrupted run has not: {got[extra[0]].describe()}")


def _difference(expected: Delivered, got: Delivered) -> str | None:
    if expected.outputs.keys() != got.outputs.keys():
        return f"outputs {sorted(got.outputs)}, expected {sorted(expected.outputs)}"
    if expected.padded != got.padded:
        return f"{got.padded} rows of padding, expected {expected.padded}"
    for name, value in expected.outputs.items():
        other = got.outputs[name]
        if len(value) != len(other):
            return f"output {name!r} has {len(other)} rows, expected {len(value)}"
        for row in range(len(value)):
            if not _same(value[row], other[row]):
                return f"output {name!r}, first differing row {row}"
    return None


def _same(expected: Any, got: Any) -> bool:
    a, b = np.asarray(expected), np.asarray(got)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _compare_samples(whole: list[Delivered], resumed: list[Delivered], key: str) -> None:
    expected = _by_sample(whole, key)
    got = _by_sample(resumed, key)
    for sample in sorted(expected):
        if sample not in got:
            epoch, index = sample
            raise AssertionError(f"sample {index} of epoch {epoch} was never delivered")
        (batch, row), (other, other_row) = expected[sample], got[sample]
        for name, value in batch.outputs.items():
            if name not in other.outputs or not _same(value[row], other.outputs[name][other_row]):
                raise AssertionError(
                    f"sample {sample[1]} of epoch {sample[0]} differs from the uninterrupted "
                    f"run's: output {name!r}, row {other_row} of the batch of "
                    f"{other.describe()} (row {row} of {batch.describe()} before)"
                )
    extra = sorted(set(got) - set(expected))
    if extra:
        raise AssertionError(f"sample {extra[0][1]} of epoch {extra[0][0]} was not expected")


def _by_sample(batches: list[Delivered], key: str) -> dict[tuple[int, int], tuple[Delivered, int]]:
    """(epoch, sample id) -> the batch and row that hold it; each sample once per epoch."""
    found: dict[tuple[int, int], tuple[Delivered, int]] = {}
    for batch in batches:
        if key not in batch.outputs:
            raise AssertionError(f"key={key!r} is not an output ({sorted(batch.outputs)})")
        for row, sample in batch.rows(key):
            if (batch.epoch, sample) in found:
                raise AssertionError(
                    f"sample {sample} of epoch {batch.epoch} was delivered twice (the second "
                    f"time in the batch of {batch.describe()})"
                )
            found[(batch.epoch, sample)] = (batch, row)
    return found
