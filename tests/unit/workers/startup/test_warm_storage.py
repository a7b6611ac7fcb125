"""The storage backends a starting worker server imports (workers.startup._warm_storage): those the
script's earlier runs opened, from a record beside DALI's source analysis. Each ``warm`` runs in
a fresh interpreter, as a starting server is one (the test process has s3fs imported)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from workers.startup import _warm_storage

ROOT = Path(__file__).resolve().parents[4]
SCRIPT = "/srv/jobs/train.py"

pytest.importorskip("s3fs")


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "analysis"
    monkeypatch.setenv("DALI_LOADER_ANALYSIS_CACHE", str(directory))
    monkeypatch.setattr(_warm_storage, "_noted", set())
    monkeypatch.setattr(_warm_storage, "_noted_modules", set())
    return directory


@pytest.fixture()
def recorded(cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The record of ``SCRIPT``, once one of its workers opened s3."""
    monkeypatch.setattr(_warm_storage, "_script", SCRIPT)
    _warm_storage.opened("s3")
    (path,) = cache.glob("*.storage.json")
    return path


def records(directory: Path) -> list[dict[str, Any]]:
    return [json.loads(path.read_text()) for path in sorted(directory.glob("*.storage.json"))]


def warm_in_fresh_interpreter(
    directory: Path, script: str, modules: tuple[str, ...] = ("s3fs",), setup: str = ""
) -> dict[str, Any]:
    """``warm(script)`` in a new interpreter: what it returned, which of ``modules`` it left
    imported, and the warnings it gave."""
    code = textwrap.dedent(
        f"""
        import json, sys, warnings
        {setup}
        from workers.startup import _warm_storage
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            imported = _warm_storage.warm({script!r})
        print(json.dumps({{
            "imported": imported,
            "modules": [name for name in {modules!r} if name in sys.modules],
            "warnings": [str(w.message) for w in caught],
        }}))
        """
    )
    env = dict(os.environ, DALI_LOADER_ANALYSIS_CACHE=str(directory), PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=directory.parent
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_a_protocol_a_worker_opened_is_imported_by_the_next_server_of_that_script(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert warm_in_fresh_interpreter(cache, SCRIPT)["modules"] == []  # (nothing recorded yet)
    monkeypatch.setattr(_warm_storage, "_script", SCRIPT)
    _warm_storage.opened("s3")
    (record,) = records(cache)
    assert record["script"] == SCRIPT and set(record["protocols"]) == {"s3"}
    warmed = warm_in_fresh_interpreter(cache, SCRIPT)
    assert warmed["imported"] == ["s3"] and warmed["modules"] == ["s3fs"]
    other = warm_in_fresh_interpreter(cache, "/srv/jobs/evaluate.py")
    assert other["imported"] == [] and other["modules"] == []  # (another script's record)


def test_a_reader_module_a_worker_used_is_imported_by_the_next_server_and_no_other_name(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Parquet reader's pyarrow (0.05 s in each worker before its first batch) is imported by
    the script's next server as it warms; a name that is not a reader's module never is, even
    written into the record by hand."""
    pytest.importorskip("pyarrow")
    modules = ("pyarrow.parquet", "json.tool")
    assert warm_in_fresh_interpreter(cache, SCRIPT, modules)["modules"] == []
    monkeypatch.setattr(_warm_storage, "_script", SCRIPT)
    monkeypatch.setattr(_warm_storage, "_noted_modules", set())
    _warm_storage.used("json.tool")  # (not a reader's: not noted)
    assert not cache.exists() or records(cache) == []
    _warm_storage.used("pyarrow.parquet")
    _warm_storage.opened("s3")
    (record,) = records(cache)
    assert set(record["modules"]) == {"pyarrow.parquet"} and set(record["protocols"]) == {"s3"}
    warmed = warm_in_fresh_interpreter(cache, SCRIPT, modules)
    assert warmed["imported"] == ["s3", "pyarrow.parquet"]
    assert warmed["modules"] == ["pyarrow.parquet"]
    (path,) = cache.glob("*.storage.json")
    record["modules"]["json.tool"] = time.time()
    path.write_text(json.dumps(record))
    warmed = warm_in_fresh_interpreter(cache, SCRIPT, modules)
    assert warmed["modules"] == ["pyarrow.parquet"]  # json.tool: not imported
    assert warm_in_fresh_interpreter(cache, "/srv/jobs/evaluate.py", modules)["modules"] == []


def test_a_parquet_reader_notes_every_module_its_definition_asks_the_server_for(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every Parquet loader's definition asks its server for pyarrow.parquet and pyarrow.compute
    (``ParquetDataset.server_needs``): a worker that imports pyarrow notes both, so that the
    script's next server imports both as it warms, during the script's set-up, instead of one of
    them on the way to the first batch (0.03 s after DALI's import)."""
    pytest.importorskip("pyarrow")
    from workers import ParquetDataset
    from workers.sources.parquet._arrow import pyarrow_modules

    monkeypatch.setattr(_warm_storage, "_script", SCRIPT)
    pyarrow_modules()
    (record,) = records(cache)
    needs = ParquetDataset("/data/train").server_needs()
    asked = {need.partition(":")[2] for need in needs if need.startswith("module:")}
    assert asked and set(record["modules"]) == asked
    modules = tuple(sorted(asked))
    assert warm_in_fresh_interpreter(cache, SCRIPT, modules)["modules"] == list(modules)


def test_a_loaders_needs_are_imported_and_a_waiting_request_stops_the_guessing(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server whose first request already waits leaves out the backends of earlier runs
    (a local job after an S3 one no longer waits 0.3 s for s3fs), and imports what the request's
    definition names instead: a backend fsspec knows, a reader's module, nothing else."""
    pytest.importorskip("pyarrow")
    monkeypatch.setattr(_warm_storage, "_script", SCRIPT)
    _warm_storage.opened("s3")
    _warm_storage.used("pyarrow.parquet")
    modules = ("s3fs", "pyarrow.parquet", "json.tool")
    code = f"""
        import json, sys
        from workers.startup import _warm_storage
        warmed = _warm_storage.warm({SCRIPT!r}, stop=lambda: True)
        needs = ["protocol:file", "protocol:no-such-store", "module:json.tool",
                 "module:pyarrow.parquet", "protocol:s3"]
        imported = _warm_storage.import_needs(needs)
        print(json.dumps([warmed, imported, [m for m in {modules!r} if m in sys.modules]]))
    """
    env = dict(os.environ, DALI_LOADER_ANALYSIS_CACHE=str(cache), PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    warmed, imported, loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert warmed == []
    assert imported == ["module:pyarrow.parquet", "protocol:s3"]
    assert loaded == ["s3fs", "pyarrow.parquet"]
    assert set(records(cache)[0]["protocols"]) == {"s3"}  # (the record: unchanged)


def test_a_worker_writes_the_record_once_and_only_for_remote_protocols_of_a_known_script(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _warm_storage.opened("s3")  # no script (a process that is no server's worker)
    assert not cache.exists() or records(cache) == []
    monkeypatch.setattr(_warm_storage, "_script", SCRIPT)
    _warm_storage.opened("file")
    _warm_storage.opened("memory")
    assert not cache.exists() or records(cache) == []
    _warm_storage.opened("s3")
    (path,) = cache.glob("*.storage.json")
    first = path.stat().st_mtime_ns
    monkeypatch.setattr(_warm_storage, "_noted", set())  # (as a second worker of the same run)
    time.sleep(0.01)
    _warm_storage.opened("s3")
    assert path.stat().st_mtime_ns == first  # recorded recently: not written again
    _warm_storage.opened("gs")
    assert set(records(cache)[0]["protocols"]) == {"s3", "gs"}


def test_a_protocol_unused_for_a_month_is_no_longer_imported_and_a_stale_one_is_refreshed(
    cache: Path, recorded: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = time.time() - _warm_storage.FORGET_AFTER - 60
    recorded.write_text(json.dumps({"script": SCRIPT, "protocols": {"s3": old}}))
    assert warm_in_fresh_interpreter(cache, SCRIPT)["modules"] == []
    monkeypatch.setattr(_warm_storage, "_noted", set())
    _warm_storage.opened("s3")  # (a run opens it again: its time is renewed)
    assert time.time() - records(cache)[0]["protocols"]["s3"] < 60
    assert warm_in_fresh_interpreter(cache, SCRIPT)["modules"] == ["s3fs"]


def test_a_damaged_record_an_unknown_protocol_or_the_switch_off_import_nothing(
    cache: Path, recorded: Path
) -> None:
    recorded.write_text('{"protocols": {"s3": ')
    assert warm_in_fresh_interpreter(cache, SCRIPT)["imported"] == []
    recorded.write_text(json.dumps({"protocols": {"no-such-store": time.time()}}))
    assert warm_in_fresh_interpreter(cache, SCRIPT)["imported"] == []
    recorded.write_text(json.dumps({"protocols": {"s3": time.time()}}))
    code = "from workers.startup import _warm_storage; import sys; "
    code += f"print(_warm_storage.warm({SCRIPT!r}), 's3fs' in sys.modules)"
    env = dict(os.environ, DALI_LOADER_ANALYSIS_CACHE="0", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.stdout.split() == ["[]", "False"], done.stderr


def test_a_backend_whose_import_starts_a_thread_is_dropped_with_a_warning(
    cache: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A thread in the server would be missing in every worker it forks."""
    (tmp_path / "threaded_store.py").write_text(
        textwrap.dedent(
            """
            import threading
            from fsspec import AbstractFileSystem

            threading.Thread(target=threading.Event().wait, daemon=True).start()

            class ThreadedStore(AbstractFileSystem):
                protocol = "threadedstore"
            """
        )
    )
    register = (
        f"sys.path.insert(0, {str(tmp_path)!r}); import fsspec; "
        "fsspec.register_implementation('threadedstore', 'threaded_store.ThreadedStore')"
    )
    monkeypatch.setattr(_warm_storage, "_script", SCRIPT)
    _warm_storage.opened("threadedstore")
    _warm_storage.opened("s3")
    warmed = warm_in_fresh_interpreter(cache, SCRIPT, setup=register)
    assert warmed["imported"] == ["s3"]
    assert any("threadedstore:// backend started a thread" in w for w in warmed["warnings"])
    assert set(records(cache)[0]["protocols"]) == {"s3"}  # not tried again


def test_the_records_of_the_scripts_run_last_are_kept(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from workers.startup import _analysis_cache

    monkeypatch.setattr(_analysis_cache, "MAX_ENTRIES", 3)
    for number in range(5):
        monkeypatch.setattr(_warm_storage, "_script", f"/srv/jobs/job{number}.py")
        monkeypatch.setattr(_warm_storage, "_noted", set())
        _warm_storage.opened("s3")
        for path in cache.glob("*.storage.json"):  # (older files: older times, as in real use)
            if json.loads(path.read_text())["script"] != _warm_storage._script:
                os.utime(path, (path.stat().st_mtime - 10,) * 2)
    kept = sorted(r["script"] for r in records(cache))
    assert kept == [f"/srv/jobs/job{n}.py" for n in (2, 3, 4)]


def test_a_server_that_imports_s3fs_loads_botocores_s3_data_for_its_workers_sessions(
    recorded: Path, cache: Path
) -> None:
    """The server loads botocore's S3 data once (no thread); a session made for a worker's S3
    filesystem shares it, and a client made from that session reads no data file again. Options
    that s3fs would give its own session (a profile) or a session of the user's keep theirs."""
    setup = "import botocore.loaders"
    code = f"""
        from workers.startup import _warm_storage
        opened = []
        real = botocore.loaders.JSONFileLoader.load_file
        def counted(self, path):  # (each data file read from disk)
            opened.append(path)
            return real(self, path)
        botocore.loaders.JSONFileLoader.load_file = counted
        import threading
        _warm_storage.warm({SCRIPT!r})
        threads = threading.active_count()
        loaded_in_server, opened[:] = list(opened), []
        loader = _warm_storage._botocore_data[0]
        plain = {{"key": "k", "secret": "s", "endpoint_url": "http://127.0.0.1:9"}}
        given = _warm_storage.with_session("s3", plain)
        import s3fs
        from fsspec.asyn import sync
        fs = s3fs.S3FileSystem(**given)
        sync(fs.loop, fs.set_session)
        print(json.dumps({{
            "threads_after_warm": threads,
            "loaded_in_server": loaded_in_server,
            "shared": given["session"].get_component("data_loader") is loader,
            "loaded_by_the_client": opened,
            "profile": "session" in _warm_storage.with_session("s3", {{**plain, "profile": "p"}}),
            "users": _warm_storage.with_session("s3", {{**plain, "session": 1}})["session"],
            "gcs": "session" in _warm_storage.with_session("gcs", plain),
        }}))
    """
    env = dict(os.environ, DALI_LOADER_ANALYSIS_CACHE=str(cache), PYTHONPATH=str(ROOT))
    env.pop("AWS_DATA_PATH", None)
    done = subprocess.run(
        [sys.executable, "-c", f"import json\n{setup}\n" + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        cwd=cache.parent,
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["threads_after_warm"] == 1
    assert any("service-2" in name for name in found["loaded_in_server"]), found
    assert found["shared"] is True
    assert found["loaded_by_the_client"] == [], found  # (all of it found in the shared loader)
    assert found["profile"] is False and found["users"] == 1 and found["gcs"] is False


def test_the_header_timestamp_parser_gives_what_botocores_gives() -> None:
    """S3's header dates (every GET's Last-Modified) are read without dateutil's general
    parser, to the same datetime, time zone object included; any other form, and a bad one,
    goes to botocore's parser (its result, its error)."""
    import random

    from botocore.utils import parse_timestamp

    days, months = (
        ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"),
        (["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"]),
    )
    draw = random.Random(7)
    values: list[Any] = [
        f"{draw.choice(days)}, {draw.randint(1, 28):02d} {draw.choice(months)} "
        f"{draw.randint(1971, 2099)} {draw.randint(0, 23):02d}:{draw.randint(0, 59):02d}:"
        f"{draw.randint(0, 59):02d} GMT"
        for _ in range(200)
    ]
    values += ["2026-12-07T16:00:00.000Z", "2026-12-07T16:00:00+02:00", 1700000000, "1700000000"]
    for value in values:
        mine, theirs = _warm_storage.header_timestamp(value), parse_timestamp(value)
        assert mine == theirs and type(mine.tzinfo) is type(theirs.tzinfo), value
    for bad in ("Mon, 99 Dec 2026 16:00:00 GMT", "not a date at all, really GMT"):
        with pytest.raises(ValueError) as mine_error:
            _warm_storage.header_timestamp(bad)
        with pytest.raises(ValueError) as their_error:
            parse_timestamp(bad)
        assert str(mine_error.value) == str(their_error.value)


def test_an_s3_filesystem_gets_its_threads_session_with_the_quick_timestamp_parser() -> None:
    """Options s3fs would make a plain session for get this thread's session, the same one
    each time (fsspec's cache of filesystems then finds a thread's earlier one), another on
    another thread; its clients parse timestamps with ``header_timestamp``. Options with a
    session of the user's, or keywords s3fs gives its own session (a profile), keep theirs."""
    import concurrent.futures

    from botocore.parsers import RestXMLParser

    plain = {"key": "k", "secret": "s", "endpoint_url": "http://127.0.0.1:9"}
    session = _warm_storage.with_session("s3", plain)["session"]
    assert _warm_storage.with_session("s3", dict(plain))["session"] is session
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        other = pool.submit(_warm_storage.with_session, "s3", plain).result()["session"]
    assert other is not session
    parser = session.get_component("response_parser_factory").create_parser("rest-xml")
    assert isinstance(parser, RestXMLParser)
    assert parser._timestamp_parser is _warm_storage.header_timestamp
    assert "session" not in _warm_storage.with_session("s3", {**plain, "profile": "p"})
    assert _warm_storage.with_session("s3", {**plain, "session": 1})["session"] == 1
    assert "session" not in _warm_storage.with_session("gcs", plain)
