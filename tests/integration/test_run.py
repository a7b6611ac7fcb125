"""A query never acts: ``len()``, ``remaining()``, ``state_dict()``, ``load_state_dict()``,
``set_epoch()`` and ``stats()`` leave the worker processes as they are, even when the next epoch
will run on other workers (a layout ``num_workers="auto"`` chose, a rank a process group settled
after the loader was built); only the next epoch's start (the first ``next()`` of an ``iter()``)
replaces them."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

from loader import Loader
from tests import pipelines as P
from tests import timing_pipelines as T

BATCH = 8
TOTAL = 96


def _ask_everything(loader: Loader, times: int = 100) -> list[tuple[int, int]]:
    """Every query, ``times`` times; what len() and remaining() said."""
    said = []
    state = loader.state_dict()
    for _ in range(times):
        said.append((len(loader), loader.remaining()))
        state = loader.state_dict()
        loader.load_state_dict(state)
        loader.set_epoch(loader.epoch)
        loader.stats()
    return said


def _ids(loader: Loader) -> list[int]:
    ids: list[int] = []
    for batch in loader:
        ids += [int(i) for i in batch["id"][: BATCH - batch.info.padded].ravel()]
        del batch
    return ids


def test_queries_leave_the_workers_of_a_layout_auto_decided_until_the_epoch_starts() -> None:
    source = functools.partial(T.sleeping_source, total=TOTAL, batch_size=BATCH, seconds=0.002)
    with Loader(source, T.id_step, batch_size=BATCH, num_workers="auto") as loader:
        earlier: list[int] = []
        for _ in range(4):  # until auto decides another layout for the next epoch
            earlier += loader.worker_pids()
            assert sorted(_ids(loader)) == list(range(TOTAL))
            running = loader.worker_pids()
            planned = loader.num_workers  # the layout the next epoch runs
            if planned != len(running):
                break
        assert planned != len(running), "auto kept its layout: nothing to test"
        said = _ask_everything(loader)
        assert loader.worker_pids() == running  # 100 of each query: not one process changed
        assert set(said) == {(len(loader), len(loader))}
        iterator = iter(loader)
        assert loader.worker_pids() == running  # iter() alone is lazy, too
        batch = next(iterator)  # the epoch starts: now the new layout's workers
        del batch
        assert len(loader.worker_pids()) == planned
        assert set(loader.worker_pids()).isdisjoint(earlier)
        rest = [int(i) for b in iterator for i in b["id"][: BATCH - b.info.padded].ravel()]
        assert len(rest) + BATCH >= TOTAL - BATCH  # (the epoch goes on on the new workers)


def test_queries_leave_the_workers_of_a_rank_a_late_process_group_settles(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Built as Lightning's launcher leaves a child rank before fit() (rank 1 of 2, a guess),
    then a process group says rank 0 of 1: the queries answer for rank 0 of 1 at once, the
    workers are re-laid only when the epoch starts."""
    dist = pytest.importorskip("torch.distributed")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("NODE_RANK", "0")
    source = functools.partial(P.sample_source, total=30, batch_size=4)
    with Loader(source, P.cast_step, batch_size=4, num_workers=2, copy=True) as loader:
        assert (loader.config.rank, loader.config.world_size) == (1, 2)
        built = loader.worker_pids()
        dist.init_process_group(
            "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
        )
        try:
            said = _ask_everything(loader)
            assert set(said) == {(8, 8)}  # rank 0 of 1: 30 samples, 8 batches
            assert (loader.config.rank, loader.config.world_size) == (0, 1)
            assert loader.worker_pids() == built
            assert loader.state_dict()["layout"] == {"world_size": 1, "num_workers": 2}
            seen: list[Any] = []
            for batch in loader:
                if not seen:
                    assert set(loader.worker_pids()).isdisjoint(built)  # re-laid at the start
                seen += [int(v) for v in batch["id"][: 4 - batch.info.padded].ravel()]
            assert sorted(seen) == list(range(30))
        finally:
            dist.destroy_process_group()
