"""A dataset definition as the Loader's source, through real workers and real DALI:
``Loader(FilesDataset(root), step, batch_size=4)`` and its kin read every sample once per epoch,
save and resume mid-epoch, and give the very stream (and state) of the ``sharded_*`` spelling
they wrap, which keeps working."""

from __future__ import annotations

import functools
import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loader import FilesDataset, Loader, MixDataset, SamplesDataset, TarsDataset
from loader.sample import list_images
from tests import pipelines as P
from tests import tar_pipelines as T

pytestmark = pytest.mark.timeout(240)


def real(batch: Any, name: str = "id") -> list[int]:
    """The rows that are samples: neither padding nor a repeat in place of a skipped one."""
    values = [int(v) for v in np.asarray(batch[name]).ravel()]
    keep = len(values) - batch.info.padded
    return [v for row, v in enumerate(values[:keep]) if row not in batch.info.replaced]


def take(loader: Loader, count: int, name: str = "id") -> tuple[list[list[int]], dict[str, Any]]:
    """``count`` batches of the next epoch, then the state (which must survive JSON)."""
    iterator = iter(loader)
    got = [real(next(iterator), name) for _ in range(count)]
    return got, json.loads(json.dumps(loader.state_dict()))


def test_files_dataset_reads_every_file_once_and_resumes_like_sharded_files(
    image_root: Path,
) -> None:
    files, _ = list_images(image_root)
    dataset = FilesDataset(files, labels=list(range(len(files))))

    def make(workers: int) -> Loader:
        return Loader(dataset, P.bytes_and_label_step, batch_size=4, num_workers=workers)

    with make(3) as loader:
        assert len(loader) == 12
        epochs = [[real(b) for b in loader] for _ in range(2)]
    for batches in epochs:
        assert sorted(i for ids in batches for i in ids) == list(range(len(files)))
    with make(3) as loader:
        taken, state = take(loader, 5)
    assert taken == epochs[0][:5]
    assert state["sampling"]["fingerprint"].startswith("files:")
    # the state of the definition is the state of sharded_files over the same files
    spelled = functools.partial(P.files_list_source, files=tuple(files))
    with Loader(spelled, P.bytes_and_label_step, batch_size=4, num_workers=3) as loader:
        loader.load_state_dict(state)
        assert taken + [real(b) for b in loader] == epochs[0]
    with make(2) as loader:  # another layout: the rest of the epoch, once each
        loader.load_state_dict(state)
        rest = [i for b in loader for i in real(b)]
    assert sorted([i for ids in taken for i in ids] + rest) == list(range(len(files)))


def test_tars_dataset_gives_the_stream_of_sharded_tars(tmp_path: Path) -> None:
    T.write_id_tars(tmp_path, 30, 7)
    urls = str(tmp_path / "train-{000..004}.tar")
    dataset = TarsDataset(urls, ext=("cls", "id"))
    with Loader(dataset, T.cls_id_step, batch_size=4, num_workers=2, copy=True) as loader:
        epochs = [[real(b) for b in loader] for _ in range(2)]
        for batches in epochs:
            assert sorted(i for ids in batches for i in ids) == list(range(30))
        assert epochs[0] != epochs[1]  # a new order every epoch
        _taken, state = take(loader, 2)
    assert state["sampling"]["fingerprint"].startswith("tars:")
    spelled = functools.partial(T.id_tars, urls=urls)
    with Loader(spelled, T.cls_id_step, batch_size=4, num_workers=2, copy=True) as loader:
        assert [[real(b) for b in loader] for _ in range(2)] == epochs


def test_samples_dataset_skips_a_failing_load_by_id() -> None:
    """on_error="skip" through a definition: the worker's control state is bound to it."""
    dataset = SamplesDataset(64, P._load_failing_37)
    with Loader(
        dataset, P.cast_step, batch_size=4, num_workers=2, on_error="skip", copy=True
    ) as loader:
        for _ in range(2):
            ids: list[int] = []
            reported: list[int] = []
            for batch in loader:
                ids += real(batch)
                reported += batch.info.skipped
            assert sorted(ids) == [i for i in range(64) if i != 37]
            assert reported == [37]
        assert [index for index, _ in loader.stats().skipped] == [37]


def test_a_definition_travels_to_spawned_workers_with_its_options() -> None:
    """Pickled by value into a spawned worker (the default start forks them from the worker
    server: the tests above); ``shuffle=False`` and ``drop_last=True`` are the definition's."""
    dataset = SamplesDataset(30, T.Ids(0), shuffle=False, drop_last=True)
    with Loader(
        dataset, P.cast_step, batch_size=4, num_workers=1, start_method="spawn", copy=True
    ) as loader:
        assert len(loader) == 7
        batches = [real(b) for b in loader]
    assert batches == [list(range(k, k + 4)) for k in range(0, 28, 4)]


def rows(batch: Any) -> list[tuple[int, int]]:
    """(source, id) of each real row."""
    return list(zip(real(batch, "source"), real(batch), strict=True))


def test_mix_dataset_takes_exact_counts_and_resumes_mid_epoch() -> None:
    names = ("src0", "src1")
    mix = MixDataset(
        {
            name: SamplesDataset(size, T.Ids(1000 * k), fingerprint=f"ids{k}")
            for k, (name, size) in enumerate(zip(names, (60, 12), strict=True))
        },
        dict(zip(names, (0.75, 0.25), strict=True)),
        epoch_size=48,
        source_output=True,
    )

    def make(source: Any = mix, workers: int = 2) -> Loader:
        return Loader(source, T.id_source_step, batch_size=4, num_workers=workers, copy=True)

    with make() as loader:
        assert len(loader) == 12
        epoch = [r for b in loader for r in rows(b)]
    assert Counter(source for source, _id in epoch) == {0: 36, 1: 12}
    assert sorted(i for s, i in epoch if s == 1) == list(range(1000, 1012))
    with make(functools.partial(T.id_mix)) as loader:  # sharded_mix: the same stream
        assert [r for b in loader for r in rows(b)] == epoch
    with make() as loader:
        iterator = iter(loader)
        taken = [r for _ in range(3) for r in rows(next(iterator))]
        state = json.loads(json.dumps(loader.state_dict()))
    assert state["sampling"]["fingerprint"].startswith("mix2:")
    with make() as loader:
        loader.load_state_dict(state)
        assert taken + [r for b in loader for r in rows(b)] == epoch
    with make(workers=3) as loader:
        loader.load_state_dict(state)
        rest = [r for b in loader for r in rows(b)]
    assert Counter(taken + rest) == Counter(epoch)


def test_a_sharded_function_given_another_batch_size_fails_the_start_naming_the_cure() -> None:
    """The old spelling still runs (the tests of sharded_* above and elsewhere); a batch size
    that is not the Loader's is refused at start."""
    source = functools.partial(P.sample_source, batch_size=8)
    with pytest.raises(ValueError, match=r"batch_size=8 but the Loader's batch_size is 4") as info:
        with Loader(source, P.cast_step, batch_size=4, num_workers=1) as loader:
            next(iter(loader))
    assert "pass the dataset's definition to the Loader" in str(info.value)


def test_the_first_batch_does_not_wait_for_the_workers_second(tmp_path: Path) -> None:
    """The trainer hands out no batch before every worker's signature, which says whether DALI
    captured the traced step: a worker sends it once DALI has built the pipeline and asks the
    source for the next batch, before that batch is loaded and run. Here the second batch's
    samples wait for a file the test writes only once it holds the first batch: a worker that
    sent its signature only after its second step would keep the first batch back until the
    samples gave up waiting."""
    gate = tmp_path / "gate"
    dataset = SamplesDataset(16, T.GatedIds(str(gate), gated_from=4), shuffle=False)
    with Loader(dataset, P.cast_step, batch_size=4, num_workers=1) as loader:
        iterator = iter(loader)
        first = real(next(iterator))
        gate.touch()
        rest = [real(batch) for batch in iterator]
    assert first == [0, 1, 2, 3]
    assert [i for batch in rest for i in batch] == list(range(4, 16))
    notes = (tmp_path / "gate.waited").read_text().splitlines()
    assert notes and set(notes) == {"opened"}, notes
