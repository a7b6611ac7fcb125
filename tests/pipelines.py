"""Module-level sources and steps for the tests: spawned workers import them by name."""

from __future__ import annotations

import os
import signal
from typing import Any

import numpy as np
import nvidia.dali.experimental.dynamic as ndd

from loader import Shard
from loader.sample import list_images

# ------------------------------------------------------------------- helpers for the tests


def ids_of(batch: Any) -> list[int]:
    """The sample ids of a delivered batch (its ``id`` output)."""
    return [int(v) for v in np.asarray(batch["id"]).ravel()]


def reader(root: Any, **kwargs: Any) -> Any:
    """A ``source`` for the Loader: :func:`id_reader` over ``root``."""
    import functools

    return functools.partial(id_reader, root=str(root), **kwargs)


# ------------------------------------------------------------------- readers over sample images


def id_reader(
    shard: Shard, root: str, batch_size: int = 4, shuffle: bool = False, pad: bool = False
) -> Any:
    """A File reader whose label is the file's global index (a sample id)."""
    files, _labels = list_images(root)
    return ndd.readers.File(
        files=files,
        labels=list(range(len(files))),
        shard_id=shard.index,
        num_shards=shard.count,
        random_shuffle=shuffle,
        seed=shard.seed,
        max_batch_size=batch_size,
        stick_to_shard=True,
        pad_last_batch=pad,
    )


def decode_step(jpegs: Any, ids: Any) -> dict[str, Any]:
    images = ndd.decoders.image(jpegs, device="cpu")
    images = ndd.resize(images, size=[16, 16])
    return {"image": ndd.crop_mirror_normalize(images, dtype=ndd.float32), "id": ids}


def raw_step(jpegs: Any, ids: Any) -> dict[str, Any]:
    """Ragged output (undecoded JPEG bytes) next to a dense one."""
    return {"jpeg": jpegs, "id": ids, "shape": ndd.peek_image_shape(jpegs)}


def tuple_step(jpegs: Any, ids: Any) -> tuple[Any, Any]:
    images = ndd.decoders.image(jpegs, device="cpu")
    return ndd.resize(images, size=[8, 8]), ids


# ------------------------------------------------------------------- ExternalSource roots


class ShardIds:
    """Re-iterable: one epoch of full batches of this shard's ids (``total`` ids overall)."""

    def __init__(self, shard: Shard, total: int, batch_size: int) -> None:
        ids = np.arange(total)
        per = np.array_split(ids, shard.count)[shard.index]
        usable = len(per) - len(per) % batch_size
        self.batches = [per[i : i + batch_size] for i in range(0, usable, batch_size)]

    def __iter__(self) -> Any:
        for chunk in self.batches:
            yield ndd.batch([np.array([i], dtype=np.int64) for i in chunk])


def id_source(shard: Shard, total: int = 64, batch_size: int = 4) -> Any:
    return ndd.ExternalSource(ShardIds(shard, total, batch_size), cycle="raise")


def cast_step(ids: Any) -> dict[str, Any]:
    return {"id": ndd.cast(ids, dtype=ndd.int64)}


def passthrough_step(ids: Any) -> dict[str, Any]:
    """Calls no DALI operator: nothing is captured, DALI falls back to eager."""
    return {"id": ids}


def dtype_by_shard_source(shard: Shard) -> Any:
    """Shard 1 yields int32 where the others yield int64: the workers' signatures disagree."""
    dtype = np.int32 if shard.index == 1 else np.int64

    class Items:
        def __iter__(self) -> Any:
            for i in range(4):
                yield ndd.batch([np.array([i], dtype=dtype)] * 2)

    return ndd.ExternalSource(Items(), cycle="raise")


def copy_step(ids: Any) -> dict[str, Any]:
    return {"id": ndd.copy(ids)}


_calls = 0


def _nth_call() -> int:
    """How many times a counting step has been called in this worker process (1 on the first)."""
    global _calls
    _calls += 1
    return _calls


def failing_step(ids: Any) -> dict[str, Any]:
    """Raises ValueError on its third call."""
    if _nth_call() == 3:
        raise ValueError("step failed on purpose")
    return {"id": ndd.cast(ids, dtype=ndd.int64)}


def killing_step(ids: Any) -> dict[str, Any]:
    """The worker kills itself with SIGKILL on its third call."""
    if _nth_call() == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return {"id": ndd.cast(ids, dtype=ndd.int64)}


def exiting_step(ids: Any) -> dict[str, Any]:
    if _nth_call() == 2:
        os._exit(3)
    return {"id": ndd.cast(ids, dtype=ndd.int64)}


def failing_source(shard: Shard) -> Any:
    raise FileNotFoundError(f"no data for shard {shard.index}")


def not_a_source(shard: Shard) -> Any:
    return [1, 2, 3]


class CustomError(Exception):
    pass


def custom_error_step(ids: Any) -> Any:
    raise CustomError("custom failure")


class NeedsArgs(Exception):
    """An exception class that cannot be built from a message alone."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(f"{code}: {detail}")


def needs_args_step(ids: Any) -> Any:
    raise NeedsArgs(7, "bad sample")


def bad_output_step(ids: Any) -> Any:
    return {"id": np.zeros(3)}


# ------------------------------------------------------------------- feeders


class Offsets:
    def __init__(self, base: int, batch_size: int) -> None:
        self.base = base
        self.batch_size = batch_size

    def __iter__(self) -> Any:
        for i in range(1000):
            yield ndd.batch([np.array([self.base + i], dtype=np.int64)] * self.batch_size)


def offset_feeders(shard: Shard, batch_size: int = 4) -> dict[str, Any]:
    return {"offset": ndd.ExternalSource(Offsets(1000 * shard.index, batch_size), cycle="raise")}


def feeder_step(ids: Any, offset: Any) -> dict[str, Any]:
    """Reads its feeder (an ndd.ExternalSource) exactly once per step."""
    return {"id": ndd.cast(ids, dtype=ndd.int64), "offset": ndd.cast(offset(), dtype=ndd.int64)}


def segfault_step(ids: Any) -> dict[str, Any]:
    """Dereferences NULL on its sixth call: with the default 4 slots per worker, the worker can
    only get there after the trainer has taken (and dropped) at least one of its batches."""
    if _nth_call() == 6:
        import ctypes

        ctypes.string_at(0)
    return {"id": ndd.cast(ids, dtype=ndd.int64)}


def stuck_step(ids: Any) -> dict[str, Any]:
    """Never returns from its second call."""
    if _nth_call() == 2:
        import time

        time.sleep(1e6)
    return {"id": ndd.cast(ids, dtype=ndd.int64)}


def failing_feeders(shard: Shard) -> dict[str, Any]:
    def explode() -> Any:
        raise KeyError("feeder callback failed")

    return {"offset": ndd.ExternalSource(explode)}


def file_root_reader(shard: Shard, root: str) -> Any:
    return ndd.readers.File(
        file_root=root, shard_id=shard.index, num_shards=shard.count, max_batch_size=2
    )


def decode_only_step(jpegs: Any, labels: Any) -> dict[str, Any]:
    return {"image": ndd.decoders.image(jpegs, device="cpu"), "label": labels}


# ------------------------------------------------------------------- execution-model rules


def sample_source(
    shard: Shard,
    total: int = 30,
    batch_size: int = 4,
    drop_last: bool = False,
    fingerprint: str | None = None,
) -> Any:
    """sharded_source over ``total`` ids: exactly-once epochs, padded rows flagged."""
    from loader import sharded_source

    return sharded_source(
        shard,
        total,
        lambda index: np.array([index], dtype=np.int64),
        batch_size,
        drop_last=drop_last,
        fingerprint=fingerprint,
    )


def _logged_id(index: int, log_dir: str) -> Any:
    """Appends ``index`` to this process's load log, then returns it as the sample."""
    with open(os.path.join(log_dir, f"loads-{os.getpid()}"), "a") as log:
        log.write(f"{index}\n")
    return np.array([index], dtype=np.int64)


def logged_source(shard: Shard, log_dir: str, total: int = 16, batch_size: int = 4) -> Any:
    """sharded_source whose load logs every sample id it loads, per worker process."""
    import functools

    from loader import sharded_source

    return sharded_source(shard, total, functools.partial(_logged_id, log_dir=log_dir), batch_size)


def logged_loads(log_dir: Any, pid: int) -> list[int]:
    """The sample ids process ``pid`` loaded, in order."""
    path = os.path.join(log_dir, f"loads-{pid}")
    if not os.path.exists(path):
        return []
    with open(path) as log:
        return [int(line) for line in log.read().split()]


_source_calls = 0


class CountingIds:
    def __iter__(self) -> Any:
        global _source_calls
        for i in range(6):
            _source_calls += 1
            yield ndd.batch([np.array([i], dtype=np.int64)] * 2)


def counting_source(shard: Shard) -> Any:
    return ndd.ExternalSource(CountingIds(), cycle="raise")


def prefetch_probe_step(ids: Any) -> dict[str, Any]:
    """Reports how many batches the source had produced when this step's body ran."""
    polled = ndd.batch([np.array([_source_calls], dtype=np.int64)] * 2)
    return {"id": ndd.cast(ids, dtype=ndd.int64), "polled": polled}


def late_feeder_step(ids: Any, offset: Any) -> dict[str, Any]:
    """Rule 4a: the feeder is first read on the second step."""
    global _calls
    _calls += 1
    out = {"id": ndd.cast(ids, dtype=ndd.int64)}
    if _calls >= 2:
        out["offset"] = ndd.cast(offset(), dtype=ndd.int64)
    return out


def skipping_feeder_step(ids: Any, offset: Any) -> dict[str, Any]:
    """Rule 4b: the feeder is read on the first step only."""
    if _nth_call() == 1:
        offset()
    return {"id": ndd.cast(ids, dtype=ndd.int64)}


def double_feeder_step(ids: Any, offset: Any) -> dict[str, Any]:
    """Rule 4b: the feeder is read twice in one step."""
    offset()
    offset()
    return {"id": ndd.cast(ids, dtype=ndd.int64)}


_shared_root: Any = None


def shared_root_source(shard: Shard) -> Any:
    global _shared_root
    _shared_root = id_source(shard)
    return _shared_root


def shared_feeders(shard: Shard) -> dict[str, Any]:
    """Rule 4c: the loop's own root handed back as a feeder (one instance in two roles)."""
    return {"offset": _shared_root}


class FewOffsets:
    def __iter__(self) -> Any:
        for i in range(2):
            yield ndd.batch([np.array([i], dtype=np.int64)] * 4)


def short_feeders(shard: Shard) -> dict[str, Any]:
    """Rule 4d: two items, while the root has eight batches per epoch."""
    return {"offset": ndd.ExternalSource(FewOffsets())}


def eagerly_used_source(shard: Shard) -> Any:
    """Rule 5: the ExternalSource is called directly before it is returned."""
    source = id_source(shard)
    source(batch_size=4)
    return source


def batch_size_step(ids: Any) -> dict[str, Any]:
    """Rule 6: from the second step on, an operator asks for another batch size than the loop's."""
    first = _nth_call() == 1
    return {"id": ndd.cast(ids, dtype=ndd.int64, batch_size=None if first else 7)}


def device_switch_step(ids: Any) -> dict[str, Any]:
    """Rule 7: the same call site switches to another device on the third step."""
    third = _nth_call() == 3
    return {"id": ndd.cast(ids, dtype=ndd.int64, device="gpu" if third else "cpu")}


def eager_then_capture_reader(shard: Shard, root: str) -> Any:
    """Rule 9: the reader is iterated eagerly before the loader captures it."""
    reader = id_reader(shard, root)
    for _ in reader.next_epoch(batch_size=4):
        break
    return reader


_contexts_made = 0


def _count_eval_contexts() -> None:
    """From now on, count every ``ndd.EvalContext`` this worker process constructs."""
    if getattr(ndd.EvalContext, "_counted_by_tests", False):
        return
    original = ndd.EvalContext.__init__

    def counted(self: Any, *args: Any, **kwargs: Any) -> None:
        global _contexts_made
        _contexts_made += 1
        original(self, *args, **kwargs)

    ndd.EvalContext.__init__ = counted  # type: ignore[method-assign]
    ndd.EvalContext._counted_by_tests = True  # type: ignore[attr-defined]


class ContextCounts(ShardIds):
    """Like ShardIds, with a second output: EvalContexts made since the first source() call."""

    def __iter__(self) -> Any:
        for chunk in self.batches:
            yield (
                ndd.batch([np.array([i], dtype=np.int64) for i in chunk]),
                ndd.batch([np.array([_contexts_made], dtype=np.int64)] * len(chunk)),
            )


def context_counting_source(shard: Shard, total: int = 64, batch_size: int = 4) -> Any:
    """Rule 8: a source whose batches say how many EvalContexts the worker made after its own."""
    _count_eval_contexts()
    return ndd.ExternalSource(ContextCounts(shard, total, batch_size), num_outputs=2, cycle="raise")


def context_count_step(ids: Any, contexts: Any) -> dict[str, Any]:
    return {"id": ndd.cast(ids, dtype=ndd.int64), "contexts": ndd.cast(contexts, dtype=ndd.int64)}


def nested_loop_step(ids: Any) -> dict[str, Any]:
    """Rule 10: the body starts a second capture loop on the worker's thread."""
    inner = ndd.ExternalSource(
        ShardIds(Shard.make(rank=0, world_size=1, worker=0, num_workers=1, seed=0), 8, 4)
    )
    for batch in inner.captured(batch_size=4):
        ndd.cast(batch, dtype=ndd.int64)
    return {"id": ndd.cast(ids, dtype=ndd.int64)}


def checkpointing_reader(shard: Shard, root: str) -> Any:
    """Rule 11: a reader built for checkpointing."""
    files, _ = list_images(root)
    return ndd.readers.File(
        files=files,
        labels=list(range(len(files))),
        shard_id=shard.index,
        num_shards=shard.count,
        max_batch_size=4,
        enable_checkpointing=True,
    )


def random_step(jpegs: Any, ids: Any) -> dict[str, Any]:
    """A captured random operator: breaking out destroys the reader (rule 12)."""
    flip = ndd.random.coin_flip(probability=0.5, batch_size=ids.batch_size)
    return {"id": ndd.cast(ids, dtype=ndd.int64), "flip": ndd.cast(flip, dtype=ndd.int64)}


def reader_feeder_step(jpegs: Any, ids: Any, offset: Any) -> dict[str, Any]:
    return {"id": ndd.cast(ids, dtype=ndd.int64), "offset": ndd.cast(offset(), dtype=ndd.int64)}


def plain_reader_step(jpegs: Any, ids: Any) -> dict[str, Any]:
    return {"id": ndd.cast(ids, dtype=ndd.int64)}


def big_source(shard: Shard) -> Any:
    """Batches of 4 x 1 MiB."""

    class Big:
        def __iter__(self) -> Any:
            for _ in range(3):
                yield ndd.batch([np.zeros(2**20, dtype=np.uint8)] * 4)

    return ndd.ExternalSource(Big(), cycle="raise")


def gpu_decode_step(jpegs: Any, ids: Any) -> dict[str, Any]:
    images = ndd.decoders.image(jpegs, device="mixed")
    images = ndd.resize(images, size=[16, 16])
    return {"image": ndd.crop_mirror_normalize(images, dtype=ndd.float32), "id": ids.gpu()}


def stuck_at_step(ids: Any, at: int) -> dict[str, Any]:
    """Sleeps far longer than any test's timeout= on the worker's step ``at`` (0-based)."""
    if _nth_call() == at + 1:
        import time

        time.sleep(30)
    return {"id": ndd.cast(ids, dtype=ndd.int64)}


def single_step(ids: Any) -> Any:
    """Returns one DALI batch, not a dict or tuple."""
    return ndd.cast(ids, dtype=ndd.int64)


def _load_failing_at_7(index: int) -> Any:
    if index == 7:
        raise ValueError("sample 7 cannot be read")
    return np.array([index], dtype=np.int64)


def failing_load_source(shard: Shard) -> Any:
    """sharded_source whose load raises for sample 7."""
    from loader import sharded_source

    return sharded_source(shard, 16, _load_failing_at_7, 4, shuffle=False)


def _slow_id(index: int, seconds: float) -> Any:
    import time

    time.sleep(seconds)
    return np.array([index], dtype=np.int64)


def slow_source(shard: Shard, total: int = 120, batch_size: int = 4, seconds: float = 0.02) -> Any:
    """sharded_source whose load sleeps ``seconds`` per sample (a resume must not pay for the
    samples before its position)."""
    import functools

    from loader import sharded_source

    return sharded_source(shard, total, functools.partial(_slow_id, seconds=seconds), batch_size)


def files_source(shard: Shard, root: str, batch_size: int = 4) -> Any:
    """sharded_files over an ImageFolder."""
    from loader import sharded_files

    return sharded_files(shard, root, batch_size=batch_size, shuffle=True)


def files_list_source(shard: Shard, files: tuple[str, ...], batch_size: int = 4) -> Any:
    """sharded_files over a list of files; the label of file k is k (a sample id)."""
    from loader import sharded_files

    return sharded_files(shard, list(files), batch_size=batch_size, labels=list(range(len(files))))


def bytes_and_label_step(data: Any, labels: Any) -> dict[str, Any]:
    images = ndd.decoders.image(data, device="cpu")
    return {"image": ndd.resize(images, size=[8, 8]), "id": ndd.cast(labels, dtype=ndd.int64)}


def decode_files_step(data: Any, labels: Any) -> dict[str, Any]:
    """Decodes every file: a corrupt one fails inside DALI."""
    images = ndd.decoders.image(data, device="cpu")
    return {"image": ndd.resize(images, size=[8, 8]), "label": ndd.cast(labels, dtype=ndd.int64)}


def flip_files_step(data: Any, labels: Any) -> dict[str, Any]:
    """A per-sample random flip whose batch size comes from the batch it flips: the same step
    runs under any batch size (``batch_size=4`` in ``coin_flip`` would tie it to batches of 4)."""
    images = ndd.resize(ndd.decoders.image(data, device="cpu"), size=[8, 8])
    flip = ndd.random.coin_flip(probability=0.5, batch_size=images.batch_size)
    return {
        "image": images,
        "flipped": ndd.flip(images, horizontal=flip),
        "flip": ndd.cast(flip, dtype=ndd.int64),
        "label": ndd.cast(labels, dtype=ndd.int64),
    }


def files_with_ids_source(shard: Shard, root: str, batch_size: int = 8) -> Any:
    """sharded_files over an ImageFolder's files, labelled by their index in the sorted list."""
    from loader import sharded_files
    from loader.sample import list_images

    files, _labels = list_images(root)
    return sharded_files(shard, files, batch_size=batch_size, labels=list(range(len(files))))


def _once(marker: str) -> bool:
    """True the first time it is called for ``marker`` (a file path), in any process."""
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def _load_hanging_once(index: int, marker: str, at: int) -> Any:
    if index == at and _once(marker):
        import time

        time.sleep(60)
    return np.array([index], dtype=np.int64)


def hanging_once_source(shard: Shard, marker: str, total: int = 64, at: int = 20) -> Any:
    """sharded_source whose load hangs on sample ``at`` the first time (in any process)."""
    import functools

    from loader import sharded_source

    load = functools.partial(_load_hanging_once, marker=marker, at=at)
    return sharded_source(shard, total, load, 4, shuffle=False)


def segfault_once_step(ids: Any, marker: str) -> dict[str, Any]:
    """Crashes the worker on its fourth step, once (in any process)."""
    if _nth_call() == 4 and _once(marker):
        import ctypes

        ctypes.string_at(0)
    return {"id": ndd.cast(ids, dtype=ndd.int64)}


def _load_failing_37(index: int) -> Any:
    if index == 37:
        raise OSError("sample 37 is unreadable")
    return np.array([index], dtype=np.int64)


def failing_37_source(shard: Shard) -> Any:
    """sharded_source over 64 ids whose load raises for sample 37."""
    from loader import sharded_source

    return sharded_source(shard, 64, _load_failing_37, 4)


def _load_slow_start(index: int) -> Any:
    if index < 4:  # the first batch of shard 0 (no shuffle): 0.8 s
        import time

        time.sleep(0.2)
    return np.array([index], dtype=np.int64)


def slow_start_source(shard: Shard) -> Any:
    """sharded_source over 64 ids in order; shard 0's first batch is slow to load."""
    from loader import sharded_source

    return sharded_source(shard, 64, _load_slow_start, 4, shuffle=False)


def _load_hanging_at(index: int, at: int) -> Any:
    if index == at:
        import time

        time.sleep(3600)  # until the trainer kills the process
    return np.array([index], dtype=np.int64)


def hanging_source(shard: Shard, at: int, total: int = 64) -> Any:
    """sharded_source over ``total`` ids (shuffled, batches of 4) whose load never returns for
    sample ``at``, in any process."""
    import functools

    from loader import sharded_source

    return sharded_source(shard, total, functools.partial(_load_hanging_at, at=at), 4)


def dying_on_seek_source(shard: Shard, marker: str) -> Any:
    """sample_source; worker 1's process dies (SIGKILL) the first time it builds its sources at
    a resumed position (load_state_dict's seek)."""
    if shard.position is not None and shard.worker == 1 and _once(marker):
        os.kill(os.getpid(), signal.SIGKILL)
    return sample_source(shard)


# ------------------------------------------------------------------- exact resume: random draws

_flip_rng: Any = None


def augment_step(jpegs: Any, labels: Any) -> dict[str, Any]:
    """Decode, random resized crop (the default RNG), a captured coin flip mirror from an RNG
    the step makes on its first call."""
    global _flip_rng
    if _flip_rng is None:
        _flip_rng = ndd.random.RNG(seed=1234)
    rng = _flip_rng
    images = ndd.decoders.image(jpegs, device="cpu")
    images = ndd.random_resized_crop(images, size=[12, 12])
    flip = ndd.random.coin_flip(probability=0.5, batch_size=images.batch_size, rng=rng)
    images = ndd.crop_mirror_normalize(images, dtype=ndd.float32, mirror=flip)
    return {"image": images, "label": ndd.cast(labels, dtype=ndd.int64)}


def uniform_step(ids: Any) -> dict[str, Any]:
    """A captured random draw (the default RNG) next to the ids: the bytes follow the RNG."""
    noise = ndd.random.uniform(range=[0.0, 1.0], shape=[2], batch_size=ids.batch_size)
    return {"id": ndd.cast(ids, dtype=ndd.int64), "noise": noise}


def broken_pattern_step(ids: Any) -> dict[str, Any]:
    """Breaks DALI's draw-pattern rule: a random call on the first two steps only."""
    out = {"id": ndd.cast(ids, dtype=ndd.int64)}
    if _nth_call() <= 2:
        out["noise"] = ndd.random.uniform(range=[0.0, 1.0], shape=[2], batch_size=ids.batch_size)
    return out


def killed_once_uniform_step(ids: Any, marker: str) -> dict[str, Any]:
    """uniform_step; the worker kills itself (SIGKILL) on its sixth step (of sample_source: the
    second of epoch 1), once in any process."""
    if _nth_call() == 6 and _once(marker):
        os.kill(os.getpid(), signal.SIGKILL)
    return uniform_step(ids)


def _id_augmented(index: int, epoch: int, files: tuple[str, ...]) -> tuple[Any, ...]:
    """A file's bytes and id, with its crop position and flip drawn from (seed, epoch, id)."""
    rng = np.random.default_rng([7, epoch, index])
    x, y = (np.float32(v) for v in rng.random(2))
    data = np.fromfile(files[index], dtype=np.uint8)
    return data, np.array([index]), x, y, np.int32(rng.integers(0, 2))


def id_augmented_source(shard: Shard, files: tuple[str, ...], batch_size: int = 4) -> Any:
    """sharded_source over image files whose random augmentation is drawn in load from the
    sample id and the epoch (pass_epoch=True): the same on any layout."""
    import functools

    from loader import sharded_source

    load = functools.partial(_id_augmented, files=files)
    return sharded_source(shard, len(files), load, batch_size, num_outputs=5, pass_epoch=True)


def id_augmented_step(jpegs: Any, ids: Any, x: Any, y: Any, flip: Any) -> dict[str, Any]:
    images = ndd.decoders.image(jpegs, device="cpu")
    images = ndd.crop_mirror_normalize(
        images, crop=(12, 12), crop_pos_x=x, crop_pos_y=y, mirror=flip, dtype=ndd.float32
    )
    return {"image": images, "id": ndd.cast(ids, dtype=ndd.int64)}
