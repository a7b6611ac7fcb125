"""Zero-copy views of a worker's slot, and the leases that give the slot back. Runs in the trainer.

A delivered batch's arrays all hang off one :class:`ipc.SlotView`. When the last of them (and of
the torch tensors made from them) is garbage-collected, a finalizer queues the slot's release in a
:class:`ReleaseQueue`; the trainer's thread sends it at its next wait. Finalizers never write to a
worker's channel themselves: they may run in any thread, or in the middle of another send.

A text output (a tar's ``.txt``/``.json`` member, ``__key__``) arrives as bytes, one uint8 array
per row (or one 2-D array, rows of one length stacked): :func:`texts` decodes it to ``list[str]``
on the trainer's side, the form a tokenizer takes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ipc import wire

from ._release_queue import ReleaseQueue


@dataclass(frozen=True, slots=True)
class BatchInfo:
    """Where a delivered batch came from. ``step`` is its step in the epoch on this rank
    (``0 .. len(loader) - 1``, counting the batches received before a resume too);
    ``worker_step`` the step in the epoch of the ``worker`` that made it. ``padded`` rows at
    its end are padding, not data. With ``on_error="skip"``, ``skipped`` names the sample ids
    left out of the batch (``skipped_names``: their names, a file's path for
    ``sharded_files``, ``<tar>:<key>`` for tars); the rows they leave are cut off by default
    (``cut_replaced=True``: the batch is that many rows shorter, and no row of it repeats
    another), or, with ``cut_replaced=False``, kept at the batch's full size holding a repeat
    of another row and listed in ``replaced`` (mask them: a contrastive loss must, or it trains
    on duplicate pairs). With ``cut_padding=True`` the padding is cut too (``padded`` is 0;
    1 in a batch of padding alone, its one row kept: every rank takes the same steps).
    ``cut`` says how many rows were cut and ``cut_rows`` which (counted in the batch as the
    worker made it)."""

    epoch: int
    step: int
    worker: int
    worker_step: int
    shard: int
    padded: int
    replaced: tuple[int, ...] = ()
    skipped: tuple[int, ...] = ()
    skipped_names: tuple[str, ...] = ()
    cut: int = 0
    cut_rows: tuple[int, ...] = ()

    @property
    def valid(self) -> int | None:
        return None if self.padded == 0 else -self.padded


def _moved(value: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``value.to(*args, **kwargs)`` for what has a ``to`` (tensors, nested batches), else
    ``value`` (numpy arrays, ints): how a trainer moves a batch to its device."""
    if isinstance(value, (list, tuple)) and not hasattr(value, "to"):
        return type(value)(_moved(item, args, kwargs) for item in value)
    to = getattr(value, "to", None)
    return value if to is None or isinstance(value, np.ndarray) else to(*args, **kwargs)


class LoadedBatch(dict[str, Any]):
    """A delivered batch from a ``step`` that returned a dict: ``name -> array``.

    ``batch.to(device)`` moves every tensor and keeps ``info``: Lightning's and accelerate's
    device transfer call it (they rebuild plain mappings without their attributes)."""

    info: BatchInfo

    def to(self, *args: Any, **kwargs: Any) -> LoadedBatch:
        moved = LoadedBatch((name, _moved(value, args, kwargs)) for name, value in self.items())
        moved.info = self.info
        return moved


class LoadedTuple(tuple[Any, ...]):
    """A delivered batch from a ``step`` that returned a tuple. ``batch.to(device)`` moves
    every tensor and keeps ``info``."""

    info: BatchInfo

    def to(self, *args: Any, **kwargs: Any) -> LoadedTuple:
        moved = LoadedTuple(_moved(value, args, kwargs) for value in self)
        moved.info = self.info
        return moved


def carry_info(rebuilt: Any, source: Any) -> Any:
    """``rebuilt`` (a batch a trainer rebuilt as ``type(batch)({...})``, which drops attributes)
    with ``source``'s ``info`` again, where it can hold one; returns ``rebuilt``."""
    info = getattr(source, "info", None)
    if (
        info is not None
        and rebuilt is not source
        and isinstance(rebuilt, (LoadedBatch, LoadedTuple))
    ):
        rebuilt.info = info
    return rebuilt


def register_pytree_nodes() -> None:
    """Let ``torch.utils._pytree`` (``tree_map``, ``torch.compile``, FSDP, ...) flatten the
    batch types and rebuild them with ``info``. Idempotent; a loader with torch output calls it
    once, at its start (not per batch)."""
    global _registered
    if _registered:
        return
    _registered = True
    from torch.utils import _pytree

    def flatten_dict(batch: LoadedBatch) -> tuple[list[Any], Any]:
        return list(batch.values()), (list(batch.keys()), getattr(batch, "info", None))

    def unflatten_dict(values: Any, context: Any) -> LoadedBatch:
        keys, info = context
        rebuilt = LoadedBatch(zip(keys, values, strict=True))
        rebuilt.info = info
        return rebuilt

    def flatten_tuple(batch: LoadedTuple) -> tuple[list[Any], Any]:
        return list(batch), getattr(batch, "info", None)

    def unflatten_tuple(values: Any, info: Any) -> LoadedTuple:
        rebuilt = LoadedTuple(values)
        rebuilt.info = info
        return rebuilt

    with contextlib.suppress(ValueError):  # registered already (another import path)
        _pytree.register_pytree_node(
            LoadedBatch, flatten_dict, unflatten_dict, serialized_type_name="loader.LoadedBatch"
        )
    with contextlib.suppress(ValueError):
        _pytree.register_pytree_node(
            LoadedTuple, flatten_tuple, unflatten_tuple, serialized_type_name="loader.LoadedTuple"
        )


_registered = False


class LoadedArray(np.ndarray):
    """The one output of a ``step`` that returned a single batch: a numpy array with ``info``."""

    info: BatchInfo

    def __array_finalize__(self, obj: Any) -> None:
        self.info = getattr(obj, "info", None)  # type: ignore[assignment]


def with_info(value: Any, info: BatchInfo) -> Any:
    """``value`` with ``.info`` set: a numpy array becomes a :class:`LoadedArray` view (same
    memory); a torch tensor or cupy array takes the attribute; a list of per-sample arrays
    becomes a :class:`LoadedList`."""
    if isinstance(value, np.ndarray):
        value = value.view(LoadedArray)
    elif isinstance(value, list):
        value = LoadedList(value)
    with contextlib.suppress(AttributeError):  # a cupy array takes no attributes
        value.info = info
    return value


class LoadedList(list[Any]):
    """The one ragged output of a ``step`` that returned a single batch: per-sample arrays."""

    info: BatchInfo


def wrap_outputs(kind: str, names: list[str], values: list[Any], info: BatchInfo) -> Any:
    """The user's batch: a LoadedBatch, a LoadedTuple, or a LoadedArray for a ``single`` step."""
    if kind == "dict":
        batch = LoadedBatch(zip(names, values, strict=True))
        batch.info = info
        return batch
    if kind == "tuple":
        batch_tuple = LoadedTuple(values)
        batch_tuple.info = info
        return batch_tuple
    return with_info(values[0], info)


def to_output(value: Any, output: str, copy: bool) -> Any:
    """A zero-copy array (numpy or cupy; or a list of them) as the user asked for it."""
    if isinstance(value, list):
        return [to_output(item, output, copy) for item in value]
    if copy:
        value = value.copy()
    if output == "torch":
        import torch

        if isinstance(value, np.ndarray):
            return torch.from_numpy(value)
        return torch.from_dlpack(value)  # type: ignore[attr-defined]
    return value


def build_batch(
    arrays: list[Any],
    lease: object,
    descriptor: wire.BatchReady,
    kind: str,
    info: BatchInfo,
    *,
    output: str,
    copy: bool,
    releases: ReleaseQueue,
    owner: Any,
    cut_padding: bool = False,
    cut_replaced: bool = False,
) -> Any:
    """The user's batch over a slot's ``arrays``. Without ``copy`` the slot's release is queued
    when ``lease`` (which every view keeps alive) is collected; with ``copy`` the caller
    releases the slot at once. ``cut_padding``: a batch with padded rows comes without them
    (views of its real rows; ``info.cut`` says how many were cut). ``cut_replaced``: a batch
    with replaced rows (repeats standing in for skipped samples) comes without them (views
    where they are at the end, else copies of the rows kept)."""
    values = [to_output(value, output, copy) for value in arrays]
    padded = info.padded if cut_padding else 0
    replaced = info.replaced if cut_replaced else ()
    if padded or replaced:
        values, info = _cut_rows(values, info, padded, replaced)
    if not copy:
        finalizer = weakref.finalize(
            lease, releases.put, owner, descriptor.slot, descriptor.generation
        )
        finalizer.atexit = False
    names = [placement.name for placement in descriptor.outputs]
    return wrap_outputs(kind, names, values, info)


def _cut_rows(
    values: list[Any], info: BatchInfo, padded: int, replaced: tuple[int, ...]
) -> tuple[list[Any], BatchInfo]:
    """The batch's ``values`` without its last ``padded`` rows and its ``replaced`` rows, and
    its info saying so (a replaced row inside the padding is cut with it when the padding is
    cut). Trailing rows alone are cut as zero-copy views (they keep the lease alive); a row cut
    in the middle takes the kept rows by index (a copy of them: numpy, torch and cupy arrays,
    and lists of per-sample arrays). A batch all of whose rows would go keeps its first: flagged
    in ``padded`` (``padded == 1``) where every row was padding, else in ``replaced`` (a repeat
    of a sample delivered before)."""
    size = len(values[0]) if values else 0
    real = size - padded
    gone = set(range(real, size)) | {row for row in replaced if 0 <= row < size}
    left = tuple(row for row in info.replaced if row not in gone)
    # (the padding rows kept: a padding row that is also flagged replaced is cut as one)
    left_padded = sum(1 for row in range(size - info.padded, size) if row not in gone)
    if size and len(gone) == size:
        # every row a repeat: one stays, flagged, so that the trainer (and every rank, in step)
        # still gets a batch, not an empty one. Flagged as what it is: padding where the batch
        # holds no sample (a worker with none of its own left: ``padded`` says so, and counts
        # of samples leave it out), a repeat where no sample of the batch could be read
        gone.discard(0)
        real, left, left_padded = (1, (), 1) if info.padded >= size else (1, (0,), 0)
    inside = sorted(row for row in gone if row < real)
    if not inside:
        values = [value[:real] for value in values]
    else:
        kept = [row for row in range(size) if row not in gone]
        values = [
            [value[row] for row in kept] if isinstance(value, list) else value[kept]
            for value in values
        ]
    cut_rows = tuple(sorted(gone))
    info = dataclasses.replace(
        info, padded=left_padded, replaced=left, cut=len(cut_rows), cut_rows=cut_rows
    )
    return values, info


def current_stream(output: str) -> Callable[[int], int]:
    """``device_id -> handle`` of the trainer's current CUDA stream for the output library."""
    if output == "torch":
        import torch

        return lambda device_id: int(torch.cuda.current_stream(device_id).cuda_stream)
    import cupy

    def cupy_stream(device_id: int) -> int:
        with cupy.cuda.Device(device_id):
            return int(cupy.cuda.get_current_stream().ptr)

    return cupy_stream


# ---------------------------------------------------------------- text outputs as str
def _row_bytes(row: Any) -> bytes:
    """One row's bytes: a numpy, torch (any device) or cupy array, or bytes."""
    if isinstance(row, (bytes, bytearray, memoryview)):
        return bytes(row)
    if isinstance(row, np.ndarray):
        return row.tobytes()
    detach = getattr(row, "detach", None)
    if detach is not None:  # torch: to the host first
        return bytes(detach().cpu().numpy().tobytes())
    get = getattr(row, "get", None)
    if get is not None and hasattr(row, "__cuda_array_interface__"):  # cupy
        return bytes(get().tobytes())
    return np.asarray(row).tobytes()


def texts(values: Any, encoding: str = "utf-8", errors: str = "strict") -> list[str]:
    """The rows of a text output of a batch (``batch["txt"]``) as ``list[str]``, one per row,
    in row order: ``captions = loader.texts(batch["txt"])``. ``values``: a list of per-row
    arrays or one 2-D array (numpy, torch or cupy); ``errors`` as for ``bytes.decode``
    (``"replace"`` for text that may not be UTF-8). A row that was cut is not there (a skipped
    sample's, and with ``cut_padding=True`` the padding); rows ``info.replaced``
    (``cut_replaced=False``) and the last ``info.padded`` repeat others."""
    if isinstance(values, (str, bytes)):
        raise TypeError("texts() takes a batch's text output (rows of bytes), not one text")
    return [_row_bytes(row).decode(encoding, errors) for row in values]


def jsons(values: Any) -> list[Any]:
    """The rows of a ``.json`` output of a batch, each parsed (:func:`texts`, then
    ``json.loads``)."""
    return [json.loads(text) if text else None for text in texts(values)]
