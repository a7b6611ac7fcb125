"""The sharded-source options (batch size, shuffle, drop_last) are declared once
(``workers.sources.plan._sampling.Batching``): every public ``sharded_*`` function and dataset
``source`` names them in its signature, every dataset definition holds them but the batch size
(the Loader's), and each passes them on as one object to BatchedSamples."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from loader import (
    FilesDataset,
    MixDataset,
    SamplesDataset,
    Shard,
    TarsDataset,
    sharded_files,
    sharded_mix,
    sharded_source,
    sharded_tars,
)
from workers.sources.plan._sampling import BatchedSamples, Batching

#: The public signatures, exactly as they were before the options were declared once (and
#: ``sharded_tars``' ``ahead_bytes``, ``optional`` and ``publish_index`` (a directory or a
#: path for ``urls``) and both file sources' ``max_image_pixels``, added since).
PUBLIC: dict[Callable[..., Any], str] = {
    sharded_source: (
        "(shard: 'Shard', total: 'int', load: 'Callable[..., Any]', batch_size: 'int', *, "
        "num_outputs: 'int' = 1, shuffle: 'bool' = True, drop_last: 'bool' = False, "
        "fingerprint: 'str | None' = None, pass_epoch: 'bool' = False) -> 'Any'"
    ),
    sharded_files: (
        "(shard: 'Shard', root_or_files: 'str | os.PathLike[str] | Sequence[str]', *, "
        "batch_size: 'int', shuffle: 'bool' = True, drop_last: 'bool' = False, "
        "labels: 'Sequence[int] | None' = None, max_image_pixels: 'int | None' = 89478485) "
        "-> 'Any'"
    ),
    sharded_tars: (
        "(shard: 'Shard', urls: 'str | os.PathLike[str] | Sequence[str]', *, "
        "batch_size: 'int', ext: 'str | Sequence[str]' = ('jpg', 'cls'), "
        "shuffle: 'bool' = True, drop_last: 'bool' = False, "
        "storage_options: 'dict[str, Any] | None' = None, "
        "shuffle_window: 'int | None' = None, ahead: 'int' = 2, retries: 'int' = 4, "
        "ahead_bytes: 'int | None' = 268435456, max_image_pixels: 'int | None' = 89478485, "
        "optional: 'Mapping[str, Any] | None' = None, publish_index: 'bool' = False) -> 'Any'"
    ),
    sharded_mix: (
        "(shard: 'Shard', sources: 'Mapping[str, Dataset]', *, "
        "weights: 'Mapping[str, float]', batch_size: 'int', epoch_size: 'int | None' = None, "
        "shuffle: 'bool' = True, drop_last: 'bool' = False, source_output: 'bool' = False) "
        "-> 'Any'"
    ),
}
#: A definition's ``source``: its options default to the definition's own (None).
DEFINITION_SOURCE = (
    "(self, shard: 'Shard', *, batch_size: 'int', shuffle: 'bool | None' = None, "
    "drop_last: 'bool | None' = None) -> 'BatchedSamples'"
)


def _load(index: int) -> Any:
    return np.array([index], dtype=np.int64)


def test_the_public_signatures_are_as_they_were() -> None:
    for function, signature in PUBLIC.items():
        assert str(inspect.signature(function)) == signature, function.__name__
    assert FilesDataset.source is TarsDataset.source is SamplesDataset.source
    assert SamplesDataset.source is MixDataset.source
    assert str(inspect.signature(SamplesDataset.source)) == DEFINITION_SOURCE


def test_every_public_signature_names_each_option_with_its_default() -> None:
    for function in PUBLIC:
        parameters = inspect.signature(function).parameters
        for option in dataclasses.fields(Batching):
            assert option.name in parameters, (function.__name__, option.name)
            default = parameters[option.name].default
            expected = (
                inspect.Parameter.empty if option.default is dataclasses.MISSING else option.default
            )
            assert default == expected, (function.__name__, option.name)


@pytest.mark.parametrize("kind", [FilesDataset, TarsDataset, SamplesDataset, MixDataset])
def test_every_definition_holds_each_option_but_the_batch_size_with_its_default(
    kind: type,
) -> None:
    """The Loader gives the batch size; the rest of Batching is the definition's, by keyword."""
    held = {f.name: f for f in dataclasses.fields(kind)}
    assert "batch_size" not in held
    for option in dataclasses.fields(Batching):
        if option.name == "batch_size":
            continue
        assert held[option.name].default == option.default, (kind.__name__, option.name)
        assert held[option.name].kw_only, (kind.__name__, option.name)


def test_the_options_reach_the_batched_samples_as_one() -> None:
    shard = Shard.make(rank=0, world_size=1, worker=0, num_workers=2, seed=3)
    samples = sharded_source(shard, 10, _load, 3, shuffle=False, drop_last=True)
    assert samples.batching == Batching(3, shuffle=False, drop_last=True)
    sampling = samples.sampling
    assert (sampling.batch_size, sampling.shuffle, sampling.drop_last) == (3, False, True)
    via_dataset = SamplesDataset(10, _load).source(shard, batch_size=3, drop_last=True)
    assert via_dataset.batching == Batching(3, drop_last=True)
    defined = SamplesDataset(10, _load, shuffle=False, drop_last=True)
    assert defined.batched(shard, 3).batching == Batching(3, shuffle=False, drop_last=True)
    assert defined.source(shard, batch_size=3, shuffle=True).batching == Batching(
        3, shuffle=True, drop_last=True
    )
    mixed = sharded_mix(
        shard, {"a": SamplesDataset(10, _load)}, weights={"a": 1.0}, batch_size=2, shuffle=False
    )
    assert mixed.batching == Batching(2, shuffle=True)  # (the mix applies shuffle)
    defined_mix = MixDataset({"a": SamplesDataset(10, _load)}, {"a": 1.0}, shuffle=False)
    assert defined_mix.batched(shard, 2).sampling == mixed.sampling


def test_batched_samples_takes_the_options_as_one_or_by_name() -> None:
    shard = Shard.make(rank=0, world_size=1, worker=0, num_workers=1, seed=0)
    by_name = BatchedSamples(shard, 10, _load, 4, shuffle=False, drop_last=True)
    as_one = BatchedSamples(shard, 10, _load, Batching(4, shuffle=False, drop_last=True))
    assert by_name.sampling == as_one.sampling and by_name.batching == as_one.batching
    assert [(list(ids), padded) for ids, padded in by_name.batches_for_epoch(0)] == [
        (list(ids), padded) for ids, padded in as_one.batches_for_epoch(0)
    ]
    with pytest.raises(TypeError, match="besides a Batching"):
        BatchedSamples(shard, 10, _load, Batching(4), drop_last=True)
    with pytest.raises(TypeError):
        BatchedSamples(shard, 10, _load, 4, unknown=True)
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        BatchedSamples(shard, 10, _load, 0)


def test_a_new_option_is_picked_by_its_name() -> None:
    """What a field added to Batching does: ``pick`` takes it from the arguments by name."""

    @dataclasses.dataclass(frozen=True)
    class WithMore(Batching):
        pad_with: int = 0

    arguments = {"shard": None, "batch_size": 4, "shuffle": False, "drop_last": True}
    assert Batching.pick(arguments) == Batching(4, False, True)
    picked = WithMore.pick({**arguments, "pad_with": 7})
    assert (picked.batch_size, picked.shuffle, picked.drop_last, picked.pad_with) == (
        4,
        False,
        True,
        7,
    )
