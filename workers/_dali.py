"""The one adapter between this project and DALI's dynamic-mode capture API.

Runs in the worker. Every capture entry point and every look at DALI's capture state goes through
here, so that a DALI release that renames ``capture=True``/``.captured()`` (newer upstream spells
them ``compile=True``/``.compiled()``) or moves its private state needs changes in one file.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from typing import Any

import numpy as np
import nvidia.dali as dali
import nvidia.dali.experimental.dynamic as ndd
import nvidia.dali.types as dali_types

DALI_VERSION: str = str(dali.__version__)


def is_reader(source: object) -> bool:
    return callable(getattr(source, "next_epoch", None))


def is_external_source(source: object) -> bool:
    return isinstance(source, ndd.ExternalSource)


def describe_source_error(source: object) -> str | None:
    """Why ``source`` cannot drive a loop, or None when it can."""
    if is_reader(source) or is_external_source(source):
        return None
    return (
        f"source(shard) must return a DALI reader (ndd.readers.*) or an ndd.ExternalSource, "
        f"got {type(source).__name__}"
    )


def probe_reader(source: Any, batch_size: int) -> int | None:
    """Open a reader now, so a bad path or empty dataset fails at start; returns the shard size.

    Only for readers: an ExternalSource has nothing to open. The reader is opened with the loop's
    own batch size, so its batch size stays what the capture loop will use.
    """
    if not is_reader(source):
        return None
    meta = source.get_metadata(batch_size=batch_size)
    from nvidia.dali.experimental.dynamic._ops import _shard_size

    return int(_shard_size(meta["epoch_size_padded"], source._shard_id, source._num_shards))


def pads_last_batch(reader: Any) -> bool:
    """A reader built with ``pad_last_batch=True`` (it repeats the last sample to fill a batch)."""
    return bool(getattr(reader, "_init_args", {}).get("pad_last_batch", False))


def sticks_to_shard(reader: Any) -> bool:
    """A reader that reads the same shard every epoch (``stick_to_shard=True``)."""
    return bool(getattr(reader, "_stick_to_shard", False))


def make_context(num_threads: int, device_id: int | None) -> Any:
    """The worker's one EvalContext, used for every epoch (rule 8)."""
    return ndd.EvalContext(num_threads=num_threads, device_id=device_id)  # type: ignore[no-untyped-call]


def seed_random(seed: int) -> None:
    """Seed this thread's default DALI RNG, so random operators repeat with the same seed."""
    ndd.random.set_seed(seed)  # type: ignore[no-untyped-call]


def _capture_context(source: object) -> Any:
    iterator = getattr(source, "_captured_iter", None)
    return None if iterator is None else iterator._capture_ctx


def will_trace(source: object, capture: bool) -> bool:
    """True when the next capture-mode epoch of ``source`` traces instead of replaying."""
    if not capture:
        return False
    ctx = _capture_context(source)
    return ctx is None or ctx.state.name == "TRACING"


def capture_state(source: object, capture: bool) -> str:
    """One of ``captured``, ``fallback`` (nothing captured), ``tracing`` or ``eager``."""
    if not capture:
        return "eager"
    ctx = _capture_context(source)
    if ctx is None:
        # A fallback tears the capture bindings down, which forgets the iterator.
        return "fallback"
    name = str(ctx.state.name)
    return {"CAPTURED": "captured", "TRACING": "tracing"}.get(name, "fallback")


def is_disabled(source: object) -> bool:
    """True when DALI has destroyed a reader (rule 12) and it must be rebuilt."""
    return bool(getattr(source, "_disabled", False))


def epoch_iterator(source: Any, batch_size: int, ctx: Any, capture: bool) -> Iterator[Any]:
    """One epoch of ``source`` in batches of ``batch_size``; traced or replayed when capturing."""
    if is_reader(source):
        return iter(source.next_epoch(batch_size=batch_size, ctx=ctx, capture=capture))
    if capture:
        return iter(source.captured(batch_size, ctx))
    return _eager_external_source(source, batch_size, ctx)


def _eager_external_source(source: Any, batch_size: int, ctx: Any) -> Iterator[Any]:
    while True:
        with ctx:
            try:
                item = source(batch_size=batch_size)
            except StopIteration:
                return
        yield item


def is_batch(value: object) -> bool:
    return isinstance(value, ndd.Batch)


def batch_device(batch: Any) -> str:
    return str(batch.device.device_type)


def storage_of(batch: Any) -> Any:
    """The evaluated ``TensorListCPU``/``TensorListGPU`` behind a batch."""
    return batch.evaluate()._storage


def numpy_dtype(storage: Any, name: str) -> np.dtype[Any]:
    try:
        return np.dtype(dali_types.to_numpy_type(storage.dtype))  # type: ignore[no-untyped-call]
    except Exception as error:
        raise TypeError(
            f"output {name!r} has DALI type {storage.dtype}, which numpy cannot hold; "
            "cast it in step() (for example ndd.cast(x, dtype=ndd.float32))"
        ) from error


def sample_shapes(storage: Any) -> list[tuple[int, ...]]:
    return [tuple(int(d) for d in shape) for shape in storage.shape()]


def layout_of(storage: Any) -> str:
    return str(storage.layout() or "")


def copy_packed(storage: Any, address: int) -> None:
    """Copy every sample of a CPU batch back to back to ``address`` in one call."""
    storage.copy_to_external(ctypes.c_void_p(address))


def context_stream(ctx: Any) -> int | None:
    """The CUDA stream handle of an EvalContext (DALI's work for this worker is ordered on it)."""
    stream = getattr(ctx, "_cuda_stream", None)
    if stream is None:
        return None
    handle = getattr(stream, "handle", None)
    return None if handle is None else int(handle)


def copy_packed_gpu(storage: Any, address: int, stream: int) -> None:
    """Copy every sample of a GPU batch back to back to device ``address``, on ``stream``.

    Blocking for the worker's host thread: DALI may reuse a pipeline's output buffer on its next
    run, so the copy must be done before the loop goes on. (The trainer never waits on the host.)
    """
    storage.copy_to_external(
        ctypes.c_void_p(address), cuda_stream=ctypes.c_void_p(stream), non_blocking=False
    )
