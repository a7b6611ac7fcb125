"""One measured run of one loader over the bucket of :mod:`bench.anchors` (a process of its own).

``python -m bench._anchor_runs LOADER MODE ENDPOINT PREFIX STATE`` with ``LOADER`` one of
``loader`` (this project's, from the project's environment; its step names DALI through
``from loader import ndd``, :mod:`bench._anchor_steps`), ``loader-direct`` (the same, the script
also importing ``nvidia.dali.experimental.dynamic`` as a step module with the direct import
does), ``litdata`` or ``mosaic`` (from the anchors' environment, which has neither DALI nor this
package: so nothing here imports them at the top). ``MODE``:

* ``first``: construct the loader, take the first batch, then read the rest of the epoch; at
  half the epoch, save the loader's state to ``STATE`` (each loader's own ``state_dict``);
* ``first-only``: the same up to that save (no epoch measured);
* ``resume``: construct, load ``STATE``, take the first batch (and stop);
* ``resume-epoch``: the same, then read the rest of the epoch and say every id it gave
  (``{"at": "rest", "ids": [...]}``): with the ids the first run had delivered at its save
  (``STATE.seen.json``), the parent tells whether the resumed epoch held every sample once.

The Parquet contenders of ``bash bench/anchors.sh --format parquet`` (:mod:`bench._anchor_parquet`)
read the place ``BENCH_ANCHORS_PLACE`` names (``local`` or ``s3``): ``pq-loader`` and
``pq-loader-summary`` (this loader's ``ParquetDataset``, over the files alone or beside the index
command's summary), ``pq-loader-ordered`` (over the files, unshuffled), ``pq-datasets`` and
``pq-datasets-reshard`` (Hugging Face ``datasets`` streaming, a file a shard or, after
``reshard()``, a row group a shard; both from ``.venv-datasets``, which has ``datasets`` and
``torchdata``), ``pq-litdata`` (LitData's ``ParquetLoader``).

Each run is a training script's start: ``torch`` first, then the loader's library, then the loader.
Each run speaks one JSON object a line on stdout: ``{"at": "imported"}`` once its imports are done,
``{"at": "first", "seconds": s, "rss_mb": m, "dali": b}`` when its first batch is in hand (its
resident memory then, and whether it holds DALI's modules), after which it waits for a line on stdin
(the parent counts the requests served so far, so the count is the same moment for every loader),
then ``{"at": "epoch", ...}``. The same work everywhere: batch 32, 2 worker processes, each JPEG
decoded and resized to 64x64, the label and the sample's id as integers; ids are counted to check
the epoch held every sample once.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from typing import Any

import torch

BATCH, WORKERS, SIZE = 32, 2, 64


def say(**record: Any) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def set_up() -> None:
    """The script's own set-up between importing its data library and building the loader
    (``BENCH_ANCHORS_SETUP`` seconds of CPU: matrix products, as a model's construction would
    spend them; 0 by default). The same for every loader."""
    seconds = float(os.environ.get("BENCH_ANCHORS_SETUP", "0") or 0)
    if seconds <= 0:
        return
    until = time.monotonic() + seconds
    weights = torch.randn(512, 512)
    while time.monotonic() < until:
        weights = torch.tanh(weights @ weights)


def resident_mb() -> float:
    """This process's resident memory now, in MB (Linux's ``/proc/self/statm``)."""
    with open("/proc/self/statm") as file:
        pages = int(file.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 1e6


def counted() -> None:
    """Wait until the parent has counted what was served so far."""
    sys.stdin.readline()


def main(argv: list[str]) -> None:
    name, mode, endpoint, prefix, state = argv
    runs = {
        "loader": run_loader,
        "loader-direct": run_direct,
        "loader-unindexed": run_unindexed,
        "litdata": run_litdata,
        "mosaic": run_mosaic,
        "pq-loader": run_parquet_loader,
        "pq-loader-summary": functools.partial(run_parquet_loader, key="summary"),
        "pq-loader-ordered": functools.partial(run_parquet_loader, shuffle=False),
        "pq-datasets": run_datasets,
        "pq-datasets-reshard": functools.partial(run_datasets, reshard=True),
        "pq-datasets-ordered": functools.partial(run_datasets, shuffle=False),
        "pq-datasets-reshard-ordered": functools.partial(run_datasets, reshard=True, shuffle=False),
        "pq-litdata": run_parquet_litdata,
    }
    # (the cache: an empty directory, at the same path for a run and its resume: LitData's state
    # names its cache directory and refuses another)
    cache = os.environ["BENCH_ANCHORS_CACHE"]
    runs[name](mode, endpoint, prefix, state, cache)


def drive(
    batches: Any,
    mode: str,
    started: float,
    total: int,
    save: Any,
    ids_of: Any,
    after_first: Any = None,
    state: str = "",
) -> None:
    """The same loop for each loader: first batch, then the epoch with a save at its half;
    ``after_first``: called once the requests before the first batch are counted."""
    iterator = iter(batches)
    first = next(iterator)
    say(
        at="first",
        seconds=time.monotonic() - started,
        rss_mb=resident_mb(),
        dali=any(name.startswith("nvidia.dali") for name in sys.modules),
    )
    counted()
    if after_first is not None:
        after_first()
    if mode == "resume":
        return
    seen = list(ids_of(first))
    if mode == "resume-epoch":
        for batch in iterator:
            seen.extend(ids_of(batch))
        say(at="rest", ids=seen)
        return
    epoch_started = time.monotonic()
    half = max(1, (total // BATCH) // 2)
    for number, batch in enumerate(iterator, start=1):
        seen.extend(ids_of(batch))
        if number == half:
            save()
            with open(f"{state}.seen.json", "w") as file:  # (what was delivered until the save)
                json.dump(seen, file)
            if mode == "first-only":
                return
    seconds = time.monotonic() - epoch_started
    say(
        at="epoch",
        seconds=seconds,
        samples=len(seen),
        unique=len(set(seen)),
        since_start=time.monotonic() - started,
    )


# -- this project's loader ----------------------------------------------------------------------


def loader_source(shard: Any, urls: str, options: dict[str, Any]) -> Any:
    from loader import sharded_tars

    return sharded_tars(
        shard, urls, batch_size=BATCH, ext=("jpg", "cls", "id"), storage_options=options
    )


def run_direct(mode: str, endpoint: str, prefix: str, state: str, cache: str) -> None:
    """This loader, its script importing DALI as ``import nvidia.dali.experimental.dynamic as
    ndd`` in a step module does: the trainer pays DALI's import (and its memory)."""
    run_loader(mode, endpoint, prefix, state, cache, direct=True)


def run_unindexed(mode: str, endpoint: str, prefix: str, state: str, cache: str) -> None:
    """This loader over a copy of the shards that was never indexed: its workers scan them
    before the first batch; the lead worker's progress goes to stderr (the parent keeps it)."""
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for quiet in ("botocore", "s3fs", "fsspec", "aiobotocore", "urllib3", "asyncio"):
        logging.getLogger(quiet).setLevel(logging.WARNING)
    run_loader(mode, endpoint, prefix, state, cache, layout_key="unindexed")


def run_loader(
    mode: str,
    endpoint: str,
    prefix: str,
    state: str,
    cache: str,
    layout_key: str = "tars",
    direct: bool = False,
) -> None:
    os.environ["DALI_LOADER_CACHE_DIR"] = cache  # (a new node's: nothing cached)
    # (imported here, as a script does at its top: the imports are timed apart from the run)
    import bench._anchor_steps  # noqa: F401
    import loader  # noqa: F401

    if direct:
        import nvidia.dali.experimental.dynamic  # noqa: F401

    say(at="imported")
    set_up()
    urls, total = _listing(prefix, layout_key)
    options = _s3fs_options(endpoint)
    started = time.monotonic()
    source = functools.partial(loader_source, urls=urls, options=options)
    _drive_loader(source, mode, started, total, state, with_start=True)


def _drive_loader(
    source: Any, mode: str, started: float, total: int, state: str, with_start: bool = False
) -> None:
    """This loader over ``source`` (a source function or a dataset definition) with 2 workers,
    a state loaded first for a resume, driven as every anchor is (:func:`drive`); with
    ``with_start``, where its start went is said too (:func:`say_start`)."""
    from bench._anchor_steps import loader_step
    from loader import Loader

    # (cut_padding: the epoch's last batch comes with its real rows only, as the anchors'
    # DataLoaders give it with drop_last=False)
    with Loader(
        source, loader_step, batch_size=BATCH, num_workers=WORKERS, cut_padding=True
    ) as loader:
        if mode.startswith("resume"):
            with open(state) as file:
                loader.load_state_dict(json.load(file))

        def save() -> None:
            with open(state, "w") as file:
                json.dump(loader.state_dict(), file)

        drive(
            loader,
            mode,
            started,
            total,
            save,
            lambda b: b["id"].reshape(-1).tolist(),
            functools.partial(say_start, loader, state) if with_start else None,
            state,
        )


def say_start(loader: Any, state: str) -> None:
    """Where this loader's start went, from its trace (``save_trace``): the worker server's
    spans after the loader was made, then each worker's (the longest of the workers), and the
    traced first step (its first ``dali`` span); seconds, in the order they began. The trace
    file is deleted, or kept at the path ``BENCH_KEEP_TRACE`` names (to read the whole start)."""
    trace = loader.save_trace(f"{state}.trace.json")
    events = json.loads(trace.read_text())["traceEvents"]
    if os.environ.get("BENCH_KEEP_TRACE"):
        os.replace(trace, os.environ["BENCH_KEEP_TRACE"])
    else:
        os.unlink(trace)
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    phases: dict[str, list[float]] = {}
    firsts: dict[int, dict[str, Any]] = {}
    for event in sorted((e for e in events if e["ph"] == "X"), key=lambda e: e["ts"]):
        if event.get("cat") == "start":
            where = "server" if names.get(event["tid"]) == "worker server" else "workers"
            phases.setdefault(f"{where}: {event['name']}", []).append(event["dur"] / 1e6)
        elif event["name"] == "dali" and event["tid"] not in firsts:
            firsts[event["tid"]] = event
    if firsts:
        phases["workers: traced first step"] = [e["dur"] / 1e6 for e in firsts.values()]
    say(at="start", phases={name: max(values) for name, values in phases.items()})


def _listing(prefix: str, key: str = "tars") -> tuple[str, int]:
    """(the tar shards' URL pattern, samples) from the bench's ``layout.json`` beside this run."""
    with open(os.environ["BENCH_ANCHORS_LAYOUT"]) as file:
        layout = json.load(file)
    return layout[key], layout["samples"]


def _s3fs_options(endpoint: str) -> dict[str, Any]:
    return {
        "key": "testing",
        "secret": "testing",
        "endpoint_url": endpoint,
        "client_kwargs": {"region_name": "us-east-1"},
    }


def _decode(jpeg: bytes) -> Any:
    """Pillow's decode and a bilinear resize, in the DataLoader's workers (the anchors'
    environment has a CPU torch; PyPI's torchvision is built for CUDA and does not load)."""
    import io

    import numpy as np
    from PIL import Image

    image = Image.open(io.BytesIO(jpeg)).convert("RGB").resize((SIZE, SIZE), Image.BILINEAR)
    return torch.from_numpy(np.asarray(image)).permute(2, 0, 1)


def _collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "image": torch.stack([_decode(s["image"]) for s in samples]),
        "label": torch.tensor([int(s["cls"]) for s in samples]),
        "id": torch.tensor([int(s["id"]) for s in samples]),
    }


#: The anchors' DataLoader arguments (the same work as this loader's).
LOADER_ARGS = {
    "batch_size": BATCH,
    "num_workers": WORKERS,
    "collate_fn": _collate,
    "drop_last": False,
}


def drive_dataloader(loader: Any, mode: str, state: str, started: float, total: int) -> None:
    """An anchor's StreamingDataLoader (LitData's or Mosaic's: the same state calls) driven."""
    if mode.startswith("resume"):
        loader.load_state_dict(torch.load(state, weights_only=False))

    def save() -> None:
        torch.save(loader.state_dict(), state)

    drive(loader, mode, started, total, save, lambda b: b["id"].tolist(), state=state)


# -- LitData ------------------------------------------------------------------------------------


def run_litdata(mode: str, endpoint: str, prefix: str, state: str, cache: str) -> None:
    from litdata import StreamingDataLoader, StreamingDataset
    from litdata.streaming import downloader

    say(at="imported")

    # (LitData fetches chunks with obstore, which refuses plain HTTP unless told: the bench's S3
    # server is on http://127.0.0.1; a real bucket is HTTPS and needs nothing)
    downloader._OBSTORE_CLIENT_OPTIONS = {
        **downloader._OBSTORE_CLIENT_OPTIONS,
        "allow_http": "true",
    }

    set_up()
    _, total = _listing(prefix)
    started = time.monotonic()
    dataset = StreamingDataset(
        f"s3://{prefix}/litdata",
        cache_dir=cache,
        shuffle=True,
        storage_options={
            "endpoint_url": endpoint,
            "aws_access_key_id": "testing",
            "aws_secret_access_key": "testing",
            "region_name": "us-east-1",
        },
    )
    drive_dataloader(StreamingDataLoader(dataset, **LOADER_ARGS), mode, state, started, total)


# -- MosaicML Streaming -------------------------------------------------------------------------


def run_mosaic(mode: str, endpoint: str, prefix: str, state: str, cache: str) -> None:
    import types

    # (streaming's __init__ imports its vision datasets, which import torchvision: unused here,
    # and PyPI's torchvision, built for CUDA, does not load beside the CPU torch)
    sys.modules.setdefault("streaming.vision", types.ModuleType("streaming.vision"))
    from streaming import StreamingDataLoader, StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    say(at="imported")

    os.environ.update(
        S3_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
    )
    clean_stale_shared_memory()
    set_up()
    _, total = _listing(prefix)
    started = time.monotonic()
    dataset = StreamingDataset(
        remote=f"s3://{prefix}/mds", local=cache, batch_size=BATCH, shuffle=True
    )
    drive_dataloader(StreamingDataLoader(dataset, **LOADER_ARGS), mode, state, started, total)


# -- Parquet: the same files, local or on the S3 server ------------------------------------------


def _parquet(key: str = "files") -> tuple[str, int, str]:
    """(the Parquet files' place, samples, ``local`` or ``s3``) from the bench's layout."""
    place = os.environ["BENCH_ANCHORS_PLACE"]
    with open(os.environ["BENCH_ANCHORS_LAYOUT"]) as file:
        layout = json.load(file)
    return layout["parquet"][place][key], layout["samples"], place


def run_parquet_loader(
    mode: str,
    endpoint: str,
    prefix: str,
    state: str,
    cache: str,
    key: str = "files",
    shuffle: bool = True,
) -> None:
    """This loader's ``ParquetDataset`` over the directory (``key="summary"``: the copy the
    index command wrote its summary beside), under ``Loader`` with 2 workers; ``shuffle=False``:
    in the files' order, as the unshuffled anchors read."""
    os.environ["DALI_LOADER_CACHE_DIR"] = cache  # (a new node's: no footer cached)
    import bench._anchor_steps  # noqa: F401  (imported as a script does, timed apart)
    from loader import ParquetDataset

    say(at="imported")
    set_up()
    url, total, place = _parquet(key)
    options = _s3fs_options(endpoint) if place == "s3" else None
    started = time.monotonic()
    dataset = ParquetDataset(
        url, columns=("image", "label", "id"), storage_options=options, shuffle=shuffle
    )
    _drive_loader(dataset, mode, started, total, state)


def _collate_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Parquet rows as ``datasets`` (``Image(decode=False)``) and LitData (``to_pylist``) give
    them: the image a ``{"bytes", "path"}`` dict; decoded as the other anchors decode."""
    return {
        "image": torch.stack([_decode(r["image"]["bytes"]) for r in rows]),
        "label": torch.tensor([int(r["label"]) for r in rows]),
        "id": torch.tensor([int(r["id"]) for r in rows]),
    }


def run_datasets(
    mode: str,
    endpoint: str,
    prefix: str,
    state: str,
    cache: str,
    reshard: bool = False,
    shuffle: bool = True,
) -> None:
    """Hugging Face ``datasets`` streaming, as its docs put it for a DataLoader with workers:
    ``load_dataset("parquet", streaming=True)``, shuffled (its buffer of 1,000), split by node
    (world 1), under torchdata's ``StatefulDataLoader`` (the ``DataLoader`` whose state the
    docs resume from); ``reshard``: a row group a shard instead of a file; ``shuffle=False``:
    in the files' order. (Shuffled, a resume loses the workers' shuffle buffers, as its docs
    say; over 4 files of 2 row groups its state saved under 2 workers did not even load: an
    ``IndexError`` in ``load_state_dict``. Unshuffled, it resumes exactly.)"""
    os.environ["HF_DATASETS_CACHE"] = os.path.join(cache, "hf")
    from datasets import Image, load_dataset
    from datasets.distributed import split_dataset_by_node
    from torchdata.stateful_dataloader import StatefulDataLoader

    say(at="imported")
    set_up()
    url, total, place = _parquet()
    options = _s3fs_options(endpoint) if place == "s3" else None
    started = time.monotonic()
    stream = load_dataset(
        "parquet",
        data_files=url.rstrip("/") + "/*.parquet",
        split="train",
        streaming=True,
        storage_options=options,
    )
    if reshard:
        stream = stream.reshard()
    stream = stream.cast_column("image", Image(decode=False))
    if shuffle:
        stream = stream.shuffle(seed=0)
    stream = split_dataset_by_node(stream, rank=0, world_size=1)
    loader = StatefulDataLoader(stream, **{**LOADER_ARGS, "collate_fn": _collate_rows})
    drive_dataloader(loader, mode, state, started, total)


def run_parquet_litdata(mode: str, endpoint: str, prefix: str, state: str, cache: str) -> None:
    """LitData's Parquet streaming as its docs put it: the directory indexed once
    (``index_parquet_dataset``, done by the bench before the runs), then
    ``StreamingDataset(..., item_loader=ParquetLoader())`` under its ``StreamingDataLoader``."""
    from litdata import StreamingDataLoader, StreamingDataset
    from litdata.streaming import downloader
    from litdata.streaming.item_loader import ParquetLoader

    say(at="imported")
    os.environ["BENCH_LITDATA_HTTP"] = "1"  # (its spawned workers: see the module's end)
    _litdata_http(downloader)
    set_up()
    url, total, place = _parquet()
    started = time.monotonic()
    remote: dict[str, Any] = {}
    if place == "s3":
        remote = {
            "cache_dir": cache,
            "storage_options": {
                "endpoint_url": endpoint,
                "aws_access_key_id": "testing",
                "aws_secret_access_key": "testing",
                "region_name": "us-east-1",
            },
        }
    dataset = StreamingDataset(url.rstrip("/"), item_loader=ParquetLoader(), shuffle=True, **remote)
    # (spawn: LitData refuses fork for its ParquetLoader, whose Polars deadlocks after a fork)
    loader = StreamingDataLoader(
        dataset,
        **{**LOADER_ARGS, "collate_fn": _collate_rows},
        multiprocessing_context="spawn",
    )
    drive_dataloader(loader, mode, state, started, total)


def _litdata_http(downloader: Any) -> None:
    """LitData's obstore client allowed plain HTTP (the local server), as in :func:`run_litdata`."""
    downloader._OBSTORE_CLIENT_OPTIONS = {
        **downloader._OBSTORE_CLIENT_OPTIONS,
        "allow_http": "true",
    }


if os.environ.get("BENCH_LITDATA_HTTP"):  # (a spawned LitData worker imports this module first)
    from litdata.streaming import downloader as _downloader

    _litdata_http(_downloader)


if __name__ == "__main__":
    main(sys.argv[1:])
