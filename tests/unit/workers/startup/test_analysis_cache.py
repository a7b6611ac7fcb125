"""DALI's source analysis kept on disk (workers.startup._analysis_cache): a file parsed once is
loaded, not parsed, by the next process, and DALI's capture classifies its call sites the same
way."""

from __future__ import annotations

import linecache
import os
import stat
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from workers.process._imports import dali_verified, warm_source_analysis
from workers.startup import _analysis_cache

pytestmark = pytest.mark.skipif(not dali_verified(), reason="needs the DALI it was made for")

# A file whose call sites DALI's capture classifies: literal and module-constant arguments,
# a local bound once, a loop variable, a parameter. ``site`` asks DALI, from inside the call,
# which of the caller's arguments it proves constant (what capture does at an operator's call).
STEP_FILE = textwrap.dedent(
    """
    import sys
    from nvidia.dali.experimental.dynamic import _source_analysis as analysis

    SIZE = 64


    def site(*args, **kwargs):
        frame = sys._getframe(1)
        inputs = list(analysis.constant_inputs(frame, args))
        named = sorted(analysis.constant_kwargs(frame, kwargs) or ())
        return inputs, named


    def step(batch):
        scale = 2.0
        found = [site(batch, 3, size=[SIZE, SIZE], mode="linear")]
        found.append(site(scale, batch, dtype=None, shift=batch))
        for i in range(2):
            found.append(site(i, 5, angle=i))
        return found
    """
)


@pytest.fixture()
def dali_analysis() -> Any:
    from nvidia.dali.experimental.dynamic import _source_analysis

    return _source_analysis


@pytest.fixture()
def parses(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts libcst parses (DALI's analysis calls ``libcst.parse_module`` once per file)."""
    import libcst

    calls: list[int] = []
    real = libcst.parse_module

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(libcst, "parse_module", counted)
    return calls


@pytest.fixture()
def step_file(tmp_path: Path, dali_analysis: Any) -> Iterator[Path]:
    path = tmp_path / "step_module.py"
    path.write_text(STEP_FILE)
    yield path
    forget(path, dali_analysis)


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "analysis-cache"
    monkeypatch.setenv(_analysis_cache.CACHE_ENV, str(directory))
    return directory


def forget(path: Path, analysis: Any) -> None:
    """What a new process starts with: DALI's caches and linecache without ``path``."""
    analysis._file_cache.pop(str(path), None)
    analysis._code_cache.clear()
    analysis._site_cache.clear()
    linecache.checkcache(str(path))
    linecache.cache.pop(str(path), None)


def classify(path: Path) -> list[Any]:
    """DALI's classification of every call site in ``path``'s ``step`` (a fresh module)."""
    name = f"step_module_{os.urandom(4).hex()}"
    namespace: dict[str, Any] = {"__name__": name}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    return namespace["step"](object())


def entries(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.analysis")) if directory.exists() else []


def test_a_file_parsed_once_is_loaded_by_the_next_process_and_classified_the_same(
    step_file: Path, cache: Path, parses: list[int], dali_analysis: Any
) -> None:
    assert warm_source_analysis([str(step_file)]) == [str(step_file)]
    assert len(parses) == 1 and len(entries(cache)) == 1
    parsed = classify(step_file)
    assert len(parses) == 1, "the trace parsed the file again after it was warmed"
    # (the file gives DALI something to prove: a constant somewhere, and something it cannot)
    flags = [flag for inputs, _ in parsed for flag in inputs]
    assert any(flags) and not all(flags), parsed
    assert any(named for _, named in parsed), parsed

    forget(step_file, dali_analysis)  # a new process
    assert warm_source_analysis([str(step_file)]) == [str(step_file)]
    assert len(parses) == 1, "the cached analysis was parsed again, not loaded"
    assert classify(step_file) == parsed
    assert len(parses) == 1

    forget(step_file, dali_analysis)  # without a warm-up, the trace parses (DALI's own way)
    assert classify(step_file) == parsed
    assert len(parses) == 2


def test_an_edited_file_is_parsed_again_and_both_versions_are_kept(
    step_file: Path, cache: Path, parses: list[int], dali_analysis: Any
) -> None:
    warm_source_analysis([str(step_file)])
    forget(step_file, dali_analysis)
    step_file.write_text(STEP_FILE.replace("scale = 2.0", "scale = 2.5  # edited"))
    warm_source_analysis([str(step_file)])
    assert len(parses) == 2 and len(entries(cache)) == 2
    classify(step_file)
    assert len(parses) == 2  # (the edited text's analysis is the one DALI holds)


def test_a_damaged_entry_is_parsed_again_and_replaced(
    step_file: Path, cache: Path, parses: list[int], dali_analysis: Any
) -> None:
    warm_source_analysis([str(step_file)])
    parsed = classify(step_file)
    (entry,) = entries(cache)
    entry.write_bytes(entry.read_bytes()[:1000])  # (cut short: a full disk, a killed writer)
    forget(step_file, dali_analysis)
    assert warm_source_analysis([str(step_file)]) == [str(step_file)]
    assert len(parses) == 2
    assert classify(step_file) == parsed
    forget(step_file, dali_analysis)
    warm_source_analysis([str(step_file)])
    assert len(parses) == 2, "the damaged entry was not replaced by a whole one"


def test_switched_off_nothing_is_written_and_every_process_parses(
    step_file: Path, tmp_path: Path, parses: list[int], dali_analysis: Any, monkeypatch: Any
) -> None:
    monkeypatch.setenv(_analysis_cache.CACHE_ENV, "0")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _analysis_cache.directory() is None
    warm_source_analysis([str(step_file)])
    forget(step_file, dali_analysis)
    warm_source_analysis([str(step_file)])
    assert len(parses) == 2
    assert not (tmp_path / "xdg").exists()


def test_a_directory_others_may_write_to_is_neither_read_nor_written(
    step_file: Path, cache: Path, parses: list[int], dali_analysis: Any
) -> None:
    warm_source_analysis([str(step_file)])
    (entry,) = entries(cache)
    cache.chmod(0o777)  # (anyone could have put a pickle there: loading it runs code)
    forget(step_file, dali_analysis)
    warm_source_analysis([str(step_file)])
    assert len(parses) == 2
    entry.unlink()
    forget(step_file, dali_analysis)
    warm_source_analysis([str(step_file)])
    assert entries(cache) == [] and len(parses) == 3
    cache.chmod(0o700)


def test_the_default_directory_is_the_users_cache_and_made_private(
    step_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(_analysis_cache.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("DALI_LOADER_CACHE_DIR", str(tmp_path / "shared-data-cache"))
    warm_source_analysis([str(step_file)])
    directory = tmp_path / "xdg" / "dali-capture-loader" / "source-analysis"
    assert len(entries(directory)) == 1
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert not (tmp_path / "shared-data-cache").exists()


def test_only_the_entries_used_last_are_kept(
    tmp_path: Path, cache: Path, dali_analysis: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_analysis_cache, "MAX_ENTRIES", 3)
    files = []
    for number in range(5):
        path = tmp_path / f"module_{number}.py"
        path.write_text(f"def f(x):\n    return g(x, {number})\n")
        files.append(path)
        warm_source_analysis([str(path)])
        os.utime(entries_of(cache, path), (number, number))  # (used in this order)
    assert len(entries(cache)) == 3
    for path in files:
        forget(path, dali_analysis)
    kept = [_analysis_cache.load_analysis(str(path), dali_analysis) for path in files]
    assert kept == [False, False, True, True, True]
    for path in files:
        forget(path, dali_analysis)


def entries_of(directory: Path, path: Path) -> Path:
    return _analysis_cache._entry_path(directory, path.read_text())


def test_the_process_pickling_is_left_as_it_was(step_file: Path, cache: Path) -> None:
    import pickle
    import types

    warm_source_analysis([str(step_file)])
    with pytest.raises((TypeError, pickle.PicklingError)):
        pickle.dumps(types.MappingProxyType({}))


def test_spawned_workers_keep_the_analysis_and_the_next_ones_load_it(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import functools

    from nvidia.dali.experimental.dynamic import _batch

    from loader import Loader
    from tests import timing_pipelines

    step_file = Path(timing_pipelines.__file__)
    expected = {
        _analysis_cache._entry_path(cache, Path(_batch.__file__).read_text()),
        _analysis_cache._entry_path(cache, step_file.read_text()),
    }
    source = functools.partial(timing_pipelines.quick_source, total=64, batch_size=8)

    def epoch() -> list[int]:
        with Loader(
            source, timing_pipelines.id_step, batch_size=8, num_workers=1, start_method="spawn"
        ) as loader:
            return sorted(int(i) for batch in loader for i in batch["id"].reshape(-1))

    ids = epoch()  # (spawned workers get this test's environment: the cache above)
    assert ids == list(range(64))
    assert expected <= set(entries(cache)), entries(cache)
    for entry in expected:
        os.utime(entry, (1, 1))
    assert epoch() == ids
    assert all(entry.stat().st_mtime > 1 for entry in expected), "not loaded by the next worker"
