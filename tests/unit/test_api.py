"""Argument checks, rank discovery, thread budget and import layering (no processes)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

import loader
from loader import Shard
from loader.config._env import default_num_threads, discover_placement
from loader.config._validate import check_importable
from tests import pipelines as P

ROOT = Path(__file__).resolve().parents[2]


def test_shard_formula() -> None:
    shard = Shard.make(rank=1, world_size=2, worker=1, num_workers=3, seed=10)
    assert (shard.index, shard.count, shard.seed, shard.epoch) == (4, 6, 14, 0)
    with pytest.raises(ValueError):
        Shard(index=0, count=2, rank=0, world_size=1, worker=1, num_workers=2, seed=0)


def test_importability_checks() -> None:
    check_importable(P.cast_step, "step")
    check_importable(functools.partial(P.id_reader, root="x"), "source")

    def local(x: object) -> object:
        return x

    with pytest.raises(TypeError, match="lambda"):
        check_importable(lambda x: x, "step")
    with pytest.raises(TypeError, match="inside a function"):
        check_importable(local, "step")
    with pytest.raises(TypeError, match="must be a function"):
        check_importable(3, "step")


def test_a_dataset_definition_is_a_source_that_must_pickle(tmp_path: Path) -> None:
    """A definition travels by value (no import by name); what it holds must pickle."""
    from loader.config._validate import check_definition

    check_definition(loader.FilesDataset(str(tmp_path)), "source")
    check_definition(loader.SamplesDataset(4, P._load_failing_37), "source")
    with pytest.raises(TypeError, match=r"source \(SamplesDataset\) cannot be sent to a worker"):
        check_definition(loader.SamplesDataset(4, lambda index: index), "source")
    with pytest.raises(TypeError, match=r"dataset definition \(FilesDataset.*source\(shard\)"):
        loader.Loader(3, P.cast_step, batch_size=4)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="cannot be sent to a worker"):
        loader.Loader(loader.SamplesDataset(4, lambda i: i), P.cast_step, batch_size=4)


def test_a_mixture_definition_is_checked_where_it_is_made() -> None:
    sources = {"a": loader.SamplesDataset(4, P._load_failing_37)}
    with pytest.raises(ValueError, match="weights must name every source once"):
        loader.MixDataset(sources, {"b": 1.0})
    with pytest.raises(TypeError, match="a dataset's definition, not a per-shard source"):
        loader.MixDataset({"a": P.cast_step}, {"a": 1.0})  # type: ignore[dict-item]
    unshuffled = loader.SamplesDataset(4, P._load_failing_37, shuffle=False)
    with pytest.raises(ValueError, match="set them on MixDataset"):
        loader.MixDataset({"a": unshuffled}, {"a": 1.0})


def test_placement_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert discover_placement(None, None).world_size == 1
    assert discover_placement(1, 4).rank == 1
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_RANK", "0")
    placed = discover_placement(None, None)
    assert (placed.rank, placed.world_size, placed.source) == (2, 3, "environment")
    with pytest.raises(ValueError, match="contradict"):
        discover_placement(0, 3)
    with pytest.raises(ValueError, match="both"):
        discover_placement(1, None)


def test_thread_budget_splits_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    monkeypatch.setattr("loader.config._env.usable_cpus", lambda: 8)
    assert default_num_threads(2) == 4
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "4")
    assert default_num_threads(2) == 1
    assert default_num_threads(1) == 2


PACKAGES = ("ipc", "workers", "loader", "bench")


def _imports(package: str) -> set[str]:
    """Every absolute module name imported anywhere in ``package`` (functions included)."""
    found = set()
    for path in (ROOT / package).rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _roots(package: str) -> set[str]:
    return {name.split(".")[0] for name in _imports(package)}


def test_imports_go_one_way() -> None:
    # the sub-packages are read too (only loader/processes imports the server's wire format)
    assert "ipc.server_wire" in _imports("loader")
    assert not _roots("ipc") & {"loader", "workers"}
    assert "loader" not in _roots("workers")


@pytest.mark.parametrize("package", PACKAGES)
def test_no_package_imports_another_packages_private_modules(package: str) -> None:
    private = sorted(
        name
        for name in _imports(package)
        if name.split(".")[0] in PACKAGES
        and name.split(".")[0] != package
        and any(part.startswith("_") for part in name.split(".")[1:])
    )
    assert private == [], f"{package} imports private modules of other packages: {private}"


def test_public_api_is_sorted() -> None:
    assert loader.__all__ == sorted(loader.__all__)
    for name in loader.__all__:
        assert hasattr(loader, name)


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(("total", "count"), [(30, 4), (7, 3), (64, 2), (5, 5)])
def test_shard_indices_cover_each_epoch_exactly_once(
    total: int, count: int, drop_last: bool
) -> None:
    from loader import shard_indices

    for epoch in range(3):
        parts = [
            shard_indices(total, i, count, epoch=epoch, seed=3, shuffle=True, drop_last=drop_last)
            for i in range(count)
        ]
        assert len({len(indices) for indices, _ in parts}) == 1  # equal steps everywhere
        real = [int(x) for indices, pad in parts for x in indices[: len(indices) - pad]]
        assert len(real) == len(set(real))
        if drop_last:
            assert len(real) == total - total % count
        else:
            assert sorted(real) == list(range(total))


def test_shard_indices_are_deterministic_per_seed_and_epoch() -> None:
    from loader import shard_indices

    a = shard_indices(100, 1, 4, epoch=2, seed=9, shuffle=True, drop_last=False)[0]
    b = shard_indices(100, 1, 4, epoch=2, seed=9, shuffle=True, drop_last=False)[0]
    c = shard_indices(100, 1, 4, epoch=3, seed=9, shuffle=True, drop_last=False)[0]
    assert a.tolist() == b.tolist() and a.tolist() != c.tolist()


def test_default_gpu_under_xdist_and_launchers(monkeypatch: pytest.MonkeyPatch) -> None:
    from loader.config._env import default_device_id

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "PYTEST_XDIST_WORKER"):
        monkeypatch.delenv(name, raising=False)
    placed = discover_placement(None, None)
    assert default_device_id(placed, 4) == 0
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw5")
    assert default_device_id(placed, 4) == 1
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert default_device_id(discover_placement(None, None), 4) == 3


def test_gpu_paths_fail_clearly_without_a_gpu() -> None:
    from ipc._cuda import SLOT_ALIGN, cuda_slot_size
    from loader import Loader

    assert cuda_slot_size(1) == SLOT_ALIGN and cuda_slot_size(SLOT_ALIGN + 1) == 2 * SLOT_ALIGN
    with pytest.raises(ValueError, match="output='torch'"):
        Loader(P.id_source, P.cast_step, batch_size=4, device="gpu")
    with pytest.raises(ValueError, match="needs device='gpu'"):
        Loader(P.id_source, P.cast_step, batch_size=4, output="cupy")
    try:
        import cupy  # noqa: F401

        have_cupy = True
    except ImportError:
        have_cupy = False
    if not have_cupy:
        with pytest.raises(ImportError, match="CuPy"):
            Loader(P.id_source, P.cast_step, batch_size=4, device="gpu", output="cupy")
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
        pytest.skip("a CUDA driver is present")
    except OSError:
        pass
    with pytest.raises(RuntimeError, match="needs an NVIDIA GPU"):
        Loader(P.id_source, P.cast_step, batch_size=4, device="gpu", output="torch")
