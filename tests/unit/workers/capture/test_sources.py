"""The capture layer's build of one shard's source (``workers.capture._sources``), in this
process with real DALI, eagerly, no workers: a dataset definition is opened with the loader's
one batch size, bound to the worker's control state and put under a DALI root made here; a
``sharded_*`` function's batches are taken the same way, their batch size checked."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loader import (
    FilesDataset,
    MixDataset,
    SamplesDataset,
    Shard,
    sharded_files,
    sharded_source,
)
from workers import dali
from workers.capture._phase import Phase
from workers.capture._sources import Sources, build_sources, delivery_info
from workers.sources import (
    SKIP_DAMAGED,
    STARTED_TOGETHER,
    BatchedSamples,
    Definition,
    SampleControl,
)
from workers.sources.plan import Batching
from workers.spec import WorkerSpec

SHARD = Shard.make(rank=0, world_size=1, worker=1, num_workers=2, seed=7)


def _spec(source: Any, batch_size: int = 4, **changes: Any) -> WorkerSpec:
    fields: dict[str, Any] = {
        "source": source,
        "step": lambda *inputs: inputs,
        "feeders": None,
        "shard": SHARD,
        "batch_size": batch_size,
        "capture": False,
        "device": "cpu",
        "device_id": None,
        "num_threads": 1,
        "num_slots": 4,
        "parent_pid": os.getpid(),
        "parent_death_signal": False,
        "log_level": 30,
    }
    return WorkerSpec(**{**fields, **changes})


def _build(spec: WorkerSpec, control: SampleControl | None = None) -> Sources:
    phases: list[Phase] = []
    built = build_sources(spec, spec.shard, phases.append, control or SampleControl())
    assert phases == [Phase.SOURCE]
    return built


def _ids(index: int) -> Any:
    return np.array([index], dtype=np.int64)


def _failing_at_3(index: int) -> Any:
    if index == 3:
        raise OSError("sample 3 is corrupt")
    return _ids(index)


def _epoch(built: Sources, batch_size: int) -> Iterator[list[int]]:
    """One eager epoch of the built root: the sample ids of each batch."""
    ctx = dali.make_context(1, None)
    for batch in dali.epoch_iterator(built.source, batch_size, ctx, False):
        first = batch[0] if isinstance(batch, tuple) else batch
        yield [int(v) for v in dali.storage_of(first).as_array().ravel()]


def test_a_definition_is_opened_with_the_loaders_batch_size_under_a_root_made_here() -> None:
    control = SampleControl()
    built = _build(_spec(SamplesDataset(30, _ids), batch_size=4), control)
    sampled = built.sampled
    assert isinstance(sampled, BatchedSamples) and sampled.batching == Batching(4)
    assert dali.is_external_source(built.source)
    assert built.steps_per_epoch == len(sampled) == 4  # 15 of 30 samples: 3 full + 1 padded
    got = list(_epoch(built, 4))
    planned = [[int(i) for i in chunk] for chunk, _pad in sampled.batches_for_epoch(0)]
    assert got == planned
    infos = [delivery_info(built, step, 4) for step in range(len(got))]
    assert [padded for padded, *_ in infos] == [pad for _, pad in sampled.batches_for_epoch(0)]
    assert built.sampling() == sampled.sampling


def test_a_definitions_own_options_reach_its_batches() -> None:
    built = _build(_spec(SamplesDataset(30, _ids, shuffle=False, drop_last=True), batch_size=4))
    assert built.sampled is not None
    assert built.sampled.batching == Batching(4, shuffle=False, drop_last=True)
    got = list(_epoch(built, 4))
    flat = [i for ids in got for i in ids]
    assert flat == list(range(flat[0], flat[0] + len(flat)))  # in order: not shuffled
    assert len(got) == len(built.sampled) == 4  # 7 full batches of 28: 3 and 4 per worker
    assert not any(pad for _, pad in built.sampled.batches_for_epoch(0))  # none padded


def test_the_definition_and_the_sharded_function_give_the_same_sampling(
    image_root: Path,
) -> None:
    """Fingerprint, parts and batches alike: a state saved through one resumes the other."""
    by_definition = _build(_spec(FilesDataset(str(image_root)), batch_size=8))
    source = functools.partial(sharded_files, root_or_files=str(image_root), batch_size=8)
    by_function = _build(_spec(source, batch_size=8))
    assert by_definition.sampled is not None and by_function.sampled is not None
    assert by_definition.sampling() == by_function.sampling()
    assert str(by_definition.sampling().fingerprint).startswith("files:")
    assert [list(c) for c, _ in by_definition.sampled.batches_for_epoch(2)] == [
        list(c) for c, _ in by_function.sampled.batches_for_epoch(2)
    ]


def test_a_mixture_definition_is_opened_like_sharded_mix() -> None:
    mix = MixDataset(
        {"a": SamplesDataset(20, _ids), "b": SamplesDataset(10, _ids)},
        {"a": 1.0, "b": 1.0},
        epoch_size=24,
        source_output=True,
    )
    built = _build(_spec(mix, batch_size=4))
    assert built.sampled is not None and built.sampled.num_outputs == 2
    assert str(built.sampling().fingerprint).startswith("mix2:")
    assert sum(len(ids) for ids in _epoch(built, 4)) == 12  # this shard's half of 24


def test_the_worker_control_state_is_bound_to_a_definitions_batches() -> None:
    """``on_error="skip"``: the failing sample is replaced, remembered by the worker's control
    and reported with the batch it was left out of."""
    reports: list[tuple[int, int, int, str]] = []
    control = SampleControl(
        "skip",
        report_skipped=lambda epoch, step, name, skip: reports.append(
            (epoch, step, skip.index, skip.kind)
        ),
    )
    dataset = SamplesDataset(16, _failing_at_3, shuffle=False)
    first = Shard.make(rank=0, world_size=1, worker=0, num_workers=2, seed=7)
    built = _build(_spec(dataset, batch_size=4, shard=first), control)  # (it holds sample 3)
    batches = list(_epoch(built, 4))
    assert 3 not in {i for ids in batches for i in ids} and control.bad == {3}
    assert [(epoch, index, kind) for epoch, _step, index, kind in reports] == [
        (0, 3, "load failed")
    ]
    skipped = [delivery_info(built, step, 4)[2] for step in range(len(batches))]
    assert (3,) in skipped


class _Contextual(Definition):
    """A definition that records what the worker lets a source see while it opens."""

    shuffle, drop_last = True, False
    seen: list[tuple[bool, str]] = []

    def _batched(self, shard: Shard, batching: Batching) -> BatchedSamples:
        self.seen.append((SKIP_DAMAGED.get(), STARTED_TOGETHER.get()))
        return BatchedSamples(shard, 8, _ids, batching)


def test_a_definition_opens_with_the_workers_on_error_and_pool_token() -> None:
    _Contextual.seen.clear()
    _build(_spec(_Contextual(), started_together="pool-1"), SampleControl("skip"))
    assert _Contextual.seen == [(True, "pool-1")]
    assert (SKIP_DAMAGED.get(), STARTED_TOGETHER.get()) == (False, "")  # reset after


def test_a_sharded_functions_batch_size_must_be_the_loaders() -> None:
    source = functools.partial(sharded_source, total=30, load=_ids, batch_size=8)
    with pytest.raises(ValueError, match=r"batch_size=8 but the Loader's batch_size is 4") as err:
        _build(_spec(source, batch_size=4))
    assert "Loader(FilesDataset(root), step, batch_size=4)" in str(err.value)


def _not_a_source(shard: Shard) -> Any:
    return [1, 2, 3]


def test_what_cannot_drive_a_loop_is_refused_naming_what_can() -> None:
    with pytest.raises(TypeError, match=r"DALI reader.*ExternalSource.*sharded_\* function.*list"):
        _build(_spec(_not_a_source))
