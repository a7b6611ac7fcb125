"""BatchedSamples in the worker's process, without one: file reads, batch assembly, and the
continuous iteration a worker runs over every epoch (real DALI batches, no workers)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from workers import Position, Shard
from workers.sources.files._files import read_file
from workers.sources.plan._control import FeedState, SampleControl
from workers.sources.plan._sampling import BatchedSamples, _batch_arrays


def _id(index: int) -> Any:
    return np.array([index], dtype=np.int64)


def _samples(total: int = 30, batch: int = 4, shard: Shard | None = None) -> BatchedSamples:
    shard = shard or Shard.make(rank=0, world_size=1, worker=1, num_workers=2, seed=5)
    return BatchedSamples(shard, total, _id, batch)


def _continuous(samples: BatchedSamples, control: SampleControl | None = None) -> FeedState:
    """Bind ``samples`` as the worker does for a loop that runs on across epochs."""
    feed = FeedState()
    feed.set_continuous(True)
    samples.bind(control or SampleControl(), feed)
    return feed


def _ids(batch: Any) -> list[int]:
    return [int(np.asarray(sample)[0]) for sample in batch]


def _expected(samples: BatchedSamples, epoch: int) -> list[list[int]]:
    return [[int(i) for i in chunk] for chunk, _ in samples.batches_for_epoch(epoch)]


def test_one_iteration_is_one_epoch_unless_continuous() -> None:
    samples = _samples()
    assert [_ids(b) for b in samples] == _expected(samples, 0)
    assert [_ids(b) for b in samples] == _expected(samples, 1)  # the next iter: epoch 1


def test_a_continuous_iteration_runs_every_epoch_in_turn_with_their_padding() -> None:
    samples = _samples()
    feed = _continuous(samples)
    stream = iter(samples)
    steps = len(samples)
    for epoch in range(3):
        got = [_ids(next(stream)) for _ in range(samples.epoch_steps(epoch))]
        assert got == _expected(samples, epoch)
        delivered = [feed.delivered() for _ in range(steps)]
        assert [(fed.epoch, fed.step, fed.padded) for fed in delivered if fed] == [
            (epoch, step, padded)
            for step, (_, padded) in enumerate(samples.batches_for_epoch(epoch))
        ]
    assert feed.delivered() is None
    # the rank's 30 samples in 8 batches, shared 4 + 4: worker 1 has the rank's last batch
    assert sum(padded for _, padded in samples.batches_for_epoch(0)) == 2


def test_a_resumed_continuous_iteration_finishes_its_epoch_then_runs_whole_ones() -> None:
    base = Shard.make(rank=0, world_size=1, worker=0, num_workers=2, seed=5)
    whole = _samples(shard=base)
    position = Position(0, ((1, (3, 1)),), continues=True)  # 1 rank; worker 0 received 3
    samples = _samples(shard=base.for_epoch(0, position))
    _continuous(samples)
    assert samples.epoch_steps(0) == 1 and samples.epoch_steps(1) == len(whole) == 4
    stream = iter(samples)
    got = [_ids(next(stream)) for _ in range(1 + 4)]
    assert got == _expected(whole, 0)[3:] + _expected(whole, 1)


def test_batch_at_goes_on_into_the_next_epoch_only_when_continuous() -> None:
    samples = _samples()
    last = len(samples) - 1
    assert samples.batch_at(0, last) == (_expected(samples, 0)[last], frozenset())
    assert samples.batch_at(0, last + 1) is None
    _continuous(samples)
    assert samples.batch_at(0, last + 1) == (_expected(samples, 1)[0], frozenset())


def test_batch_at_knows_which_ids_a_loaded_batch_replaced() -> None:
    """A sample found bad after a batch was loaded was in it (and may have broken it); one
    known bad before the load was replaced there and cannot have."""
    samples = _samples()
    first, second = _expected(samples, 0)[:2]
    control = SampleControl("skip", {first[0]})
    samples.bind(control, FeedState())
    stream = iter(samples)
    assert first[0] not in _ids(next(stream))  # replaced by a good sample of the batch
    assert second[0] in _ids(next(stream))
    control.add_bad([second[0]])  # learnt after batch 1 was loaded (another worker's find)
    assert samples.batch_at(0, 0) == (first, frozenset({first[0]}))
    assert samples.batch_at(0, 1) == (second, frozenset())


def test_a_load_that_raises_is_remembered_reported_once_and_not_loaded_again() -> None:
    """on_error="skip": the failing id joins the worker's bad set (before the next batch loads)
    and is reported once; the next epochs replace it without calling ``load``."""
    shard = Shard.make(rank=0, world_size=1, worker=0, num_workers=1, seed=5)
    loads: list[int] = []

    def load(index: int) -> Any:
        loads.append(index)
        if index == 5:
            raise OSError("corrupt")
        return _id(index)

    samples = BatchedSamples(shard, 16, load, 4)
    reports: list[tuple[int, int, int, str, str, str]] = []
    control = SampleControl(
        "skip",
        (),
        lambda epoch, step, name, skip: reports.append(
            (epoch, step, skip.index, name, skip.reason, skip.kind)
        ),
    )
    _continuous(samples, control)
    stream = iter(samples)
    batches = [_ids(next(stream)) for _ in range(3 * len(samples))]
    assert control.bad == {5}
    assert all(5 not in batch for batch in batches)
    assert loads.count(5) == 1
    step = next(k for k, ids in enumerate(_expected(samples, 0)) if 5 in ids)
    assert reports == [(0, step, 5, "5", "load raised OSError: corrupt", "load failed")]


def test_a_sharded_source_is_numpy_batches_that_the_dali_adapter_feeds_without_copying() -> None:
    """``sharded_source`` gives DALI-free batches (numpy: a stacked array or a list of views);
    the worker's adapter (``workers.dali.batches_root``) makes the ``ndd.ExternalSource`` that
    feeds them to DALI, viewing the arrays, not copying them."""
    import nvidia.dali.experimental.dynamic as ndd

    from workers import dali, sharded_source

    shard = Shard.make(rank=0, world_size=1, worker=0, num_workers=1, seed=5)
    samples = sharded_source(shard, 30, _id, 4)
    assert isinstance(samples, BatchedSamples) and (samples.total, samples.batch_size) == (30, 4)
    first = next(iter(samples))
    assert isinstance(first, np.ndarray) and first.shape == (4, 1)  # small samples: stacked
    root = dali.batches_root(samples)
    assert isinstance(root, ndd.ExternalSource)
    epoch = samples.epoch  # (the next ``iter()`` runs this one)
    batches = dali.epoch_iterator(root, 4, dali.make_context(1, None), False)
    got = [_ids(dali.storage_of(batch).as_array()) for batch in batches]
    assert got == _expected(samples, epoch)
    large = [np.full(5000, k, np.uint8) for k in range(4)]
    viewed = ndd.as_batch(large)
    assert np.shares_memory(np.asarray(viewed.evaluate()._storage[0]), large[0])


def test_a_layout_without_a_full_batch_for_every_worker_is_refused_with_drop_last() -> None:
    shard = Shard.make(rank=0, world_size=1, worker=1, num_workers=2, seed=0)
    with pytest.raises(ValueError, match=r"1 full batch.*fewer than its 2 workers.*at most 1"):
        BatchedSamples(shard, 5, _id, 4, drop_last=True)  # one full batch for two workers


def test_a_shard_whose_batches_were_all_received_ends_a_continuous_iteration_there() -> None:
    base = Shard.make(rank=0, world_size=1, worker=1, num_workers=2, seed=0)
    position = Position(0, ((1, (1, 2)),), continues=True)  # 10 samples, 3 batches: 1 + 2
    samples = BatchedSamples(base.for_epoch(0, position), 10, _id, 4)
    _continuous(samples)
    assert samples.epoch_steps(0) == 0 and samples.epoch_steps(1) == len(samples) == 2
    stream = iter(samples)
    assert _ids(next(stream)) == _expected(samples, 1)[0]  # epoch 1 at once


def test_small_equal_samples_are_stacked_and_others_stay_views() -> None:
    labels = [np.array([k], dtype=np.int32) for k in range(6)]
    stacked = _batch_arrays(labels)
    assert isinstance(stacked, np.ndarray) and stacked.shape == (6, 1)
    assert stacked.ravel().tolist() == list(range(6))
    ragged = [np.zeros(n, np.uint8) for n in (3, 4)]
    assert _batch_arrays(ragged) is ragged
    mixed = [np.zeros(2, np.int32), np.zeros(2, np.int64)]
    assert _batch_arrays(mixed) is mixed
    large = [np.zeros(4096, np.uint8)] * 2
    assert _batch_arrays(large) is large


def test_read_file_returns_the_bytes_and_names_a_bad_path(tmp_path: Path) -> None:
    path = tmp_path / "a.jpg"
    payload = os.urandom(70_000)
    path.write_bytes(payload)
    data = read_file(str(path))
    assert data.dtype == np.uint8 and data.tobytes() == payload
    empty = tmp_path / "empty.jpg"
    empty.write_bytes(b"")
    assert read_file(str(empty)).size == 0
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(IsADirectoryError, match=re.escape(str(tmp_path))):
        read_file(str(tmp_path))
    with pytest.raises(FileNotFoundError, match=re.escape("missing.jpg")):
        read_file(str(tmp_path / "missing.jpg"))
    assert len(os.listdir("/proc/self/fd")) == before  # no descriptor left open


def test_a_sample_of_another_number_of_outputs_than_num_outputs_is_refused() -> None:
    """``num_outputs=2`` and a load returning one array took its rows as the two outputs; a
    tuple of 3 lost its third silently. A tuple (or list) of exactly num_outputs is taken."""
    from workers.sources.plan._sampling import _output

    pair = (np.zeros(2), np.ones(3))
    assert _output(pair, 1, 2) is pair[1] and _output(list(pair), 0, 2) is pair[0]
    with pytest.raises(TypeError, match=r"load returned one ndarray for num_outputs=2: return"):
        _output(np.zeros(2), 0, 2)
    with pytest.raises(TypeError, match=r"load returned a tuple of 3 for num_outputs=2"):
        _output((*pair, np.zeros(1)), 0, 2)
    one = np.zeros(3)
    assert _output(one, 0, 1) is one and _output((one,), 0, 1) is one
