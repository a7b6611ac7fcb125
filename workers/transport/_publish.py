"""Publishing one batch: normalise ``step``'s outputs, copy them into a slot, send a descriptor.

Runs in the worker, on its main thread. The memory behind the slots (memfd arena or CUDA ring) is
chosen once, when the :class:`Publisher` is made; after that publishing never branches on it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from ipc import ControlChannel, SlotWriter, cuda_regions, memfd_regions, place_outputs, wire

from .. import dali
from ..spec import WorkerSpec
from ._timing import BatchClock


class Publisher:
    """Writes batches into the worker's slots and tells the trainer where they are."""

    def __init__(
        self,
        spec: WorkerSpec,
        channel: ControlChannel,
        ctx: Any,
        wait_for_trainer: Callable[[], None],
    ) -> None:
        """``wait_for_trainer()`` handles one record from the trainer; it is called while every
        slot is in the trainer's hands (the trainer's releases arrive that way)."""
        self.channel = channel
        self.device = spec.device
        self.device_id = spec.device_id
        self._wait_for_trainer = wait_for_trainer
        self.blocked_ns = 0
        if spec.device == "gpu":
            assert spec.device_id is not None
            create = cuda_regions(spec.device_id, spec.num_slots, dali.context_stream(ctx))
        else:
            create = memfd_regions(
                f"dali-capture-loader-w{spec.shard.worker}",
                f"worker {spec.shard.worker} ({spec.shard.describe()})",
                spec.num_slots,
                spec.shm_limit,
            )
        self.writer = SlotWriter(spec.num_slots, create, channel)

    def release(self, fills: tuple[tuple[int, int], ...]) -> None:
        for slot, generation in fills:
            self.writer.release(slot, generation)

    def set_free_events(self, arena_id: int, handles: tuple[bytes, ...]) -> None:
        region = self.writer.region(arena_id)
        setter = getattr(region, "set_free_events", None)
        if setter is None:
            raise wire.ProtocolError(f"free events for arena {arena_id}, which is not a CUDA ring")
        setter(handles)

    def acquire_slot(self) -> int:
        slot = self.writer.acquire()
        if slot is not None:
            return slot
        started = time.perf_counter_ns()
        while slot is None:
            self._wait_for_trainer()
            slot = self.writer.acquire()
        self.blocked_ns += time.perf_counter_ns() - started
        return slot

    def publish(
        self,
        epoch: int,
        step: int,
        named: dict[str, Any],
        started_ns: int,
        padded: int,
        replaced: tuple[int, ...] = (),
        skipped: tuple[int, ...] = (),
        skipped_names: tuple[str, ...] = (),
        random: wire.RandomStates = b"",
        clock: BatchClock | None = None,
        defaulted: tuple[tuple[str, int], ...] = (),
        reads: tuple[int, int, int] = (0, 0, 0),
    ) -> None:
        """Copy one batch into a free slot, one packed copy per output, then send its
        descriptor (with ``random``, the random generators' states after its step, and the
        stage times ``clock`` took of it)."""
        storages, described = self._describe(named)
        if clock is not None:
            clock.evaluated()
        placements, nbytes = place_outputs(described)
        blocked_before = self.blocked_ns
        slot, arena_id, generation = self._copy(storages, placements, nbytes)
        blocked = self.blocked_ns - blocked_before
        timing = wire.NO_STAGE_TIMES if clock is None else clock.stages(blocked)
        self.channel.send(
            wire.BatchReady(
                epoch=epoch,
                step=step,
                arena_id=arena_id,
                slot=slot,
                generation=generation,
                outputs=placements,
                nbytes=nbytes,
                padded=padded,
                blocked_ns=blocked,
                busy_ns=time.perf_counter_ns() - started_ns - blocked,
                replaced=replaced,
                skipped=skipped,
                skipped_names=skipped_names,
                random=random,
                timing=timing,
                defaulted=defaulted,
                reads=reads,
            )
        )

    def _describe(self, named: dict[str, Any]) -> tuple[list[Any], list[Any]]:
        """Each output's storage (on this publisher's device) and what the layout needs of it:
        name, dtype, item size, sample shapes, DALI layout."""
        storages, described = [], []
        for name, batch in named.items():
            storage = dali.storage_of(dali.to_device(batch, self.device, self.device_id))
            dtype = dali.numpy_dtype(storage, name)
            storages.append(storage)
            shapes = dali.sample_shapes(storage)
            described.append((name, dtype.str, dtype.itemsize, shapes, dali.layout_of(storage)))
        return storages, described

    def _copy(self, storages: list[Any], placements: Any, nbytes: int) -> tuple[int, int, int]:
        """A free slot (blocking until one is), the outputs copied into it packed; the slot, its
        arena and generation."""
        slot = self.acquire_slot()
        try:
            region = self.writer.reserve(nbytes)
            base = region.address(slot)
            stream = region.copy_stream()
            for storage, placement in zip(storages, placements, strict=True):
                if placement.nbytes:
                    dali.copy_packed(storage, base + placement.offset, stream)
            arena_id, generation = self.writer.publish(slot)
        except BaseException:
            self.writer.abandon(slot)
            raise
        return slot, arena_id, generation

    def close(self) -> None:
        self.writer.close()


def normalize_outputs(outputs: Any) -> tuple[dict[str, Any], str]:
    """``step``'s result as ``{name: Batch}`` plus its kind: ``dict``, ``tuple`` or ``single``."""
    if isinstance(outputs, Mapping):
        named, kind = {str(k): v for k, v in outputs.items()}, "dict"
    elif isinstance(outputs, (tuple, list)):
        named, kind = {str(i): v for i, v in enumerate(outputs)}, "tuple"
    else:
        named, kind = {"0": outputs}, "single"
    if not named:
        raise ValueError("step() returned no outputs; return a dict or tuple of DALI batches")
    sizes = set()
    for name, value in named.items():
        if not dali.is_batch(value):
            raise TypeError(
                f"step() output {name!r} is a {type(value).__name__}, not a DALI Batch; "
                "return the batches produced by DALI operators (not samples or numpy arrays)"
            )
        sizes.add(value.batch_size)
    if len(sizes) != 1:
        raise ValueError(f"step() outputs have different batch sizes: {sorted(sizes)}")
    return named, kind


def describe_outputs(named: Mapping[str, Any]) -> tuple[wire.OutputSchema, ...]:
    return tuple(
        wire.OutputSchema(
            name=name,
            dtype=str(batch.dtype),
            ndim=int(batch.ndim),
            layout=str(batch.layout or ""),
        )
        for name, batch in named.items()
    )
