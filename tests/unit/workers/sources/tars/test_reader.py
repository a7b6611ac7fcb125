"""The tar loader: remote shards read one range per shard."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from tests import tar_pipelines as T
from workers.sources.tars._order import TarOrder
from workers.sources.tars._reader import parse_ext
from workers.sources.tars._shards import open_shards


def test_remote_shards_are_read_one_range_per_shard_not_one_request_per_sample(
    tmp_path: Path,
) -> None:
    """Over fsspec's in-memory filesystem (a remote storage to the loader): an epoch planned
    with ``expect`` reads each shard once, ahead, and every sample comes out right."""
    import fsspec

    from workers.sources.tars._reader import TarLoader

    memory = fsspec.filesystem("memory")
    for path in T.write_id_tars(tmp_path, 30, 7):
        memory.pipe(f"/shards-{os.getpid()}/{path.name}", path.read_bytes())
    try:
        shards = open_shards(f"memory://shards-{os.getpid()}/train-{{000..004}}.tar", None, 0.0)
        assert not shards.storage.local
        loader = TarLoader(shards, parse_ext(("cls", "id")), 1, ["cls", "id"])
        reads: list[tuple[str, int, int]] = []
        read = shards.storage.read

        def counted(path: str, start: int, end: int, expect: Any = None) -> np.ndarray:
            reads.append((path, start, end))
            return read(path, start, end, expect)

        shards.storage.read = counted  # type: ignore[method-assign]
        ids = TarOrder(shards, 0, 3, 2).at(np.arange(30))
        batches = [ids[k : k + 4] for k in range(0, 30, 4)]
        loader.expect(0, batches)
        for step, batch in enumerate(batches):
            for index in batch.tolist():
                cls, got = loader(index)
                assert int(got[0]) == index and int(cls[0]) == index % 3
            loader.passed(0, step)
        assert sorted(path for path, _start, _end in reads) == sorted(
            f"memory://shards-{os.getpid()}/train-{k:03d}.tar" for k in range(5)
        )
    finally:
        memory.rm(f"/shards-{os.getpid()}", recursive=True)


def test_the_reader_imports_no_offline_tool() -> None:
    """The writer and the index command stay out of the worker's reading path."""
    from tests.unit.test_layers import import_graph

    graph = import_graph()
    seen, todo = set(), ["workers.sources.tars._reader"]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(t for t in graph[module] if t.startswith("workers.sources.tars."))
    assert "workers.sources.tars._shards" in seen
    assert not seen & {"workers.sources.tars._tool", "workers.sources.tars._writer"}
