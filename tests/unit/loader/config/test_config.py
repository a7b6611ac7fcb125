"""LoaderConfig.build: every argument checked (each error says what to change), what follows from
them settled, and the result a plain picklable value. No worker is started."""

from __future__ import annotations

import inspect
import math
import pickle
import re
from pathlib import Path
from typing import Any

import pytest

from loader import Loader
from loader.config import Layout
from loader.config._config import START_METHOD_ENV, LoaderConfig
from tests import timing_pipelines as T


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", START_METHOD_ENV):
        monkeypatch.delenv(name, raising=False)


def _build(**arguments: Any) -> LoaderConfig:
    source = arguments.pop("source", T.quick_source)
    step = arguments.pop("step", T.id_step)
    return LoaderConfig.build(source, step, **{"batch_size": 4, **arguments})


BAD = [
    ({"batch_size": 0}, ValueError, "batch_size must be >= 1, got 0"),
    ({"batch_size": 2.5}, ValueError, "batch_size must be an integer >= 1, got 2.5"),
    ({"batch_size": "4"}, TypeError, "batch_size must be an int, got str ('4')"),
    ({"batch_size": True}, TypeError, "batch_size must be an int, got bool (True)"),
    ({"num_workers": 0}, ValueError, "num_workers must be >= 1, got 0"),
    (
        {"num_workers": "four"},
        ValueError,
        "num_workers must be a positive int or 'auto', got 'four'",
    ),
    ({"num_workers": 2.0}, ValueError, "num_workers must be an integer >= 1, got 2.0"),
    (
        {"num_workers": None},
        TypeError,
        "num_workers must be a positive int or 'auto', got NoneType (None)",
    ),
    ({"num_threads": 0}, ValueError, "num_threads must be >= 1, got 0"),
    ({"num_threads": "x"}, ValueError, "num_threads must be a positive int or 'auto', got 'x'"),
    (
        {"num_threads": [1]},
        TypeError,
        "num_threads must be a positive int or 'auto', got list ([1])",
    ),
    ({"prefetch": 0}, ValueError, "prefetch must be >= 1, got 0"),
    ({"prefetch": "2"}, TypeError, "prefetch must be an int, got str ('2')"),
    ({"output": "jax"}, ValueError, "output must be one of 'numpy', 'torch', 'cupy', got 'jax'"),
    ({"device": "tpu"}, ValueError, "device must be one of 'cpu', 'gpu', got 'tpu'"),
    ({"seed": 1.0}, TypeError, "seed must be an int, got float"),
    ({"seed": True}, TypeError, "seed must be an int, got bool"),
    (
        {"seed": -1},
        ValueError,
        "seed must be >= 0 (each shard draws with seed + its index), got -1",
    ),
    ({"timeout": 0}, ValueError, "timeout must be a positive number of seconds or None, got 0"),
    (
        {"timeout": math.inf},
        ValueError,
        "timeout must be a positive number of seconds or None, got inf",
    ),
    ({"timeout": "1"}, TypeError, "timeout must be a number of seconds, got str"),
    (
        {"startup_timeout": None},
        TypeError,
        "startup_timeout must be a number of seconds, got NoneType",
    ),
    (
        {"startup_timeout": 0},
        ValueError,
        "startup_timeout must be a positive number of seconds, got 0",
    ),
    ({"shm_limit": 0}, ValueError, "shm_limit must be >= 1, got 0"),
    ({"shm_limit": "1"}, TypeError, "shm_limit must be an int, got str ('1')"),
    ({"max_restarts": -1}, ValueError, "max_restarts must be >= 0, got -1"),
    ({"max_restarts": None}, TypeError, "max_restarts must be an int, got NoneType (None)"),
    ({"on_error": "ignore"}, ValueError, "on_error must be one of 'raise', 'skip', got 'ignore'"),
    ({"max_skipped": -1}, ValueError, "max_skipped must be >= 0, got -1"),
    ({"max_skipped": 2.0}, ValueError, "max_skipped must be an integer >= 0, got 2.0"),
    ({"trace": 3}, TypeError, "trace must be a file path (str or Path), got int"),
    ({"trace": ""}, ValueError, "trace must name a file, for example trace='loader-trace.json'"),
    (
        {"trace": "/nonexistent-folder/x.json"},
        ValueError,
        "trace='/nonexistent-folder/x.json': the folder '/nonexistent-folder' does not exist; "
        "create it first",
    ),
    ({"copy": "no"}, TypeError, "copy must be True or False, got 'no'"),
    ({"capture": 1}, TypeError, "capture must be True or False, got 1"),
    ({"in_order": None}, TypeError, "in_order must be True or False, got None"),
    ({"cut_padding": "yes"}, TypeError, "cut_padding must be True or False, got 'yes'"),
    ({"start_method": "fork"}, ValueError, "start_method='fork' is refused"),
    (
        {"start_method": "thread"},
        ValueError,
        "start_method must be one of 'spawn', 'forkserver', got 'thread'",
    ),
    ({"rank": 0}, ValueError, "pass both rank= and world_size=, or neither"),
    ({"rank": 2, "world_size": 2}, ValueError, "rank must be in [0, world_size=2), got 2"),
    ({"rank": 0, "world_size": 0}, ValueError, "world_size must be >= 1, got 0"),
    ({"device": "gpu"}, ValueError, "device='gpu' delivers batches in GPU memory: pass output="),
    ({"output": "cupy"}, ValueError, "output='cupy' needs device='gpu'"),
    ({"device_id": 0}, ValueError, "device_id= is only meaningful with device='gpu'"),
    ({"memory_limit": 100}, ValueError, "memory_limit= is the memory budget of num_workers='auto'"),
    (
        {"num_workers": "auto", "memory_limit": 0},
        ValueError,
        "memory_limit must be a positive number of bytes, got 0",
    ),
    ({"feeders": {"a": 1}}, TypeError, "feeders must be a module-level function feeders(shard)"),
    ({"feeders": 3}, TypeError, "feeders must be a function, got int"),
    (
        {"source": 3},
        TypeError,
        "source must be a dataset definition (FilesDataset, TarsDataset, SamplesDataset, "
        "MixDataset) or a function source(shard), got int",
    ),
    ({"step": lambda ids: ids}, TypeError, "step is a lambda; workers are spawned"),
]


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    BAD,
    ids=[f"{i}-{'-'.join(case[0])}" for i, case in enumerate(BAD)],
)
def test_each_bad_argument_says_what_to_change(
    arguments: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=f"^{re.escape(message)}"):
        _build(**arguments)


def test_a_folder_is_no_trace_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=re.escape(f"trace={str(tmp_path)!r} is a folder")):
        _build(trace=tmp_path)
    assert _build(trace=tmp_path / "t.json").trace == str(tmp_path / "t.json")


def test_the_keywords_not_given_take_the_loaders_defaults() -> None:
    defaults = {
        name: parameter.default
        for name, parameter in inspect.signature(Loader.__init__).parameters.items()
        if parameter.default is not inspect.Parameter.empty
    }
    assert _build() == _build(**defaults)
    config = _build(timeout=5, num_workers=3, num_threads=2, rank=1, world_size=3)
    assert (config.timeout, config.startup_timeout) == (5.0, 300.0)
    assert (config.num_workers, config.num_threads, config.num_threads_given) == (3, 2, True)
    assert (config.rank, config.world_size, config.placement_source) == (1, 3, "arguments")
    assert (config.start_method, config.device_id, config.memory_limit) == (
        "forkserver",
        None,
        None,
    )


def test_what_auto_tunes_stays_zero_until_the_layout_plan_decides() -> None:
    config = _build(num_workers="auto", memory_limit=10**9)
    assert (config.num_workers, config.num_threads) == (0, 0)
    assert (config.workers_auto, config.threads_auto, config.num_threads_given) == (
        True,
        False,
        False,
    )
    assert config.memory_limit == 10**9
    laid = config.with_layout(Layout(3, 1), first_epoch=2)
    assert (laid.num_workers, laid.num_threads, laid.first_epoch) == (3, 1, 2)
    assert [shard.worker for shard in laid.shards] == [0, 1, 2]


def test_a_config_and_its_worker_specs_pickle() -> None:
    config = _build(num_workers=2, num_threads=1, seed=7, on_error="skip")
    again = pickle.loads(pickle.dumps(config))
    assert again == config and again.shards == config.shards
    specs = pickle.loads(pickle.dumps(config.worker_specs()))
    assert [(s.shard.worker, s.batch_size, s.on_error) for s in specs] == [
        (0, 4, "skip"),
        (1, 4, "skip"),
    ]


def test_build_refuses_what_the_loader_has_no_keyword_for() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'cpus'"):
        _build(cpus=3)
    with pytest.raises(TypeError, match="missing required argument: 'batch_size'"):
        LoaderConfig.build(T.quick_source, T.id_step)
