"""The one adapter between this project and DALI's dynamic-mode capture API.

Runs in the worker. Every capture entry point and every look at DALI's capture state goes through
here, so that a DALI release that renames ``capture=True``/``.captured()`` (newer upstream spells
them ``compile=True``/``.compiled()``) or moves its private state needs changes in one file.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import nvidia.dali as dali
import nvidia.dali.experimental.dynamic as ndd
import nvidia.dali.types as dali_types

DALI_VERSION: str = str(dali.__version__)


def is_reader(source: object) -> bool:
    return callable(getattr(source, "next_epoch", None))


def is_external_source(source: object) -> bool:
    return isinstance(source, ndd.ExternalSource)


class SampleBatches(Protocol):
    """What :func:`batches_root` feeds to DALI: re-iterable, each ``iter()`` one run of full
    batches, each batch one output (a list of numpy arrays, or one array whose rows are the
    samples) or a tuple of ``num_outputs`` of them. (The sources' ``BatchedSamples`` is one;
    this adapter does not import them: the sources know nothing of DALI.)"""

    @property
    def num_outputs(self) -> int: ...

    def __iter__(self) -> Iterator[Any]: ...


class _AsBatches:
    """``batches`` as DALI batches: each output wrapped with ``ndd.as_batch``, which views the
    numpy arrays without copying them (``ndd.batch`` would copy every batch, and its first copy
    makes DALI's trace parse its own 1,000-line ``_batch.py`` with libcst, ~0.45 s per worker).
    DALI copies a fed batch into its own buffers; the source keeps the last few arrays alive."""

    def __init__(self, batches: SampleBatches) -> None:
        self._batches = batches

    def __iter__(self) -> Iterator[Any]:
        if self._batches.num_outputs == 1:
            for arrays in self._batches:
                yield ndd.as_batch(arrays)
        else:
            for outputs in self._batches:
                yield tuple(ndd.as_batch(arrays) for arrays in outputs)


def batches_root(batches: SampleBatches) -> Any:
    """The ``ndd.ExternalSource`` root that pulls ``batches`` (the worker makes it over the
    batches of a dataset definition or a ``sharded_*`` function)."""
    return ndd.ExternalSource(_AsBatches(batches), num_outputs=batches.num_outputs, cycle="raise")


def describe_source_error(source: object) -> str | None:
    """Why ``source`` cannot drive a loop, or None when it can."""
    if is_reader(source) or is_external_source(source):
        return None
    return (
        "source(shard) must return a DALI reader (ndd.readers.*), an ndd.ExternalSource or "
        f"what a sharded_* function returns, got {type(source).__name__}"
    )


@dataclass(frozen=True)
class ReaderShard:
    """One epoch of a reader's current shard, as DALI reads it with the loop's batch size.

    ``real``: the distinct samples of the shard. ``steps``: the batches DALI yields per epoch.
    Rows past ``real`` in the last ``steps * batch_size - real`` rows are not new samples: with
    ``pad_last_batch=True`` they repeat the shard's last sample; without it they wrap around (to
    the shard's start with ``stick_to_shard=True``, into the next shard otherwise).
    """

    real: int
    steps: int


def probe_reader(source: Any, batch_size: int) -> ReaderShard | None:
    """Open a reader now, so a bad path or empty dataset fails at start; returns its shard.

    Only for readers (None for an ExternalSource, which has nothing to open). The reader is
    opened with the loop's own batch size: one built without ``max_batch_size`` gets
    ``batch_size``, as DALI's own first ``next_epoch`` would give it (opening it without one would
    pin DALI's operator to batches of 1); one built with a different ``max_batch_size`` raises
    ``ValueError`` here instead of failing the first capture-mode step with DALI's bare
    ``Assert on "ref_batch_size == output_batch_size" failed``.

    What DALI 2.4 does, measured on ``readers.File`` (N files, S shards, batch size B, eager and
    capture mode alike, every epoch alike when the reader sticks to its shard):

    * shard ``i`` holds files ``floor(i*N/S)`` up to ``floor((i+1)*N/S)``, in order: that count
      is ``real`` (200 files over 3 shards: 66, 67, 67);
    * metadata ``epoch_size_padded`` is ``S * ceil(N/S)`` with ``pad_last_batch=True`` (201 for
      200 over 3), ``N`` without; each epoch the loop reads batches of B until it has
      ``floor((i+1)*P/S) - floor(i*P/S)`` rows of that padded size P, so ``steps`` is
      ``ceil(ceil(N/S) / B)`` for *every* shard with padding (a shorter shard yields as many
      batches as a longer one: 200 over 3 with B=8 gives 9 batches on each shard, 66 or 67 real
      rows then repeats; with B=66, shard 0's second batch is all padding), and
      ``ceil(real / B)`` per shard without;
    * with ``pad_last_batch=True`` every row after the shard's ``real`` rows repeats its last
      sample, and every batch is full.

    For a reader that does not stick to its shard, DALI moves to the next shard after each
    epoch; the result describes the shard it reads next.
    """
    if not is_reader(source):
        return None
    max_batch_size = getattr(source, "_max_batch_size", None)
    if max_batch_size is None:
        source._max_batch_size = batch_size
    elif int(max_batch_size) != batch_size:
        raise ValueError(
            f"the reader was built with max_batch_size={max_batch_size} but the Loader's "
            f"batch_size is {batch_size}: pass max_batch_size=batch_size to the reader (take "
            "both from one place, e.g. functools.partial)"
        )
    meta = source.get_metadata(batch_size=batch_size)
    from nvidia.dali.experimental.dynamic._ops import _shard_size

    shard_id, num_shards = int(source._shard_id), int(source._num_shards)
    real = int(_shard_size(int(meta["epoch_size"]), shard_id, num_shards))
    # DALI's epoch loop: batches of batch_size until this shard's part of epoch_size_padded.
    rows = int(_shard_size(int(meta["epoch_size_padded"]), shard_id, num_shards))
    return ReaderShard(real=real, steps=-(-rows // batch_size))


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


def default_generator() -> Any:
    """This thread's default ``ndd.random.RNG`` (random operators without ``rng=`` draw from it)."""
    return ndd.random.get_default_rng()  # type: ignore[no-untyped-call]


def generator_state(generator: Any) -> str:
    """An RNG's state as DALI writes it: one ASCII word that ``set_generator_state`` takes back."""
    return str(generator.get_state())


def set_generator_state(generator: Any, state: str) -> None:
    """Put an RNG in ``state``. Only between capture loops: DALI forbids it while a loop that
    draws from the RNG is live (its schedule of draws would no longer hold)."""
    generator.set_state(state)


def generator_key(state: str) -> str:
    """What stays the same in an RNG's state while it draws: DALI 2.4 writes a Philox state as
    ``Philox_<key>_<counter>_<phase>`` and the key is the seed it was made with; drawing moves
    the counter only. Two generators made with the same seed share a key."""
    kind, _, rest = state.partition("_")
    return f"{kind}_{rest.partition('_')[0]}"


def watch_draws(on_draw: Callable[[Any], None]) -> Callable[[], None]:
    """Call ``on_draw(rng)`` before every draw of every ``ndd.random.RNG`` (a random operator's,
    a bare ``rng()``, an ``advance``), before DALI's capture layer sees it; returns the function
    that stops it. ``on_draw`` may set the RNG's state: DALI's capture layer anchors an RNG's
    schedule at its first draw, after this call. (DALI 2.4 reports draws through the class's
    ``_on_draw`` hook, which its capture layer replaces; this wraps that one.)"""
    generator_class: Any = ndd.random.RNG
    captured = generator_class._on_draw

    def on_draw_then_dali(generator: Any) -> None:
        on_draw(generator)
        captured(generator)

    generator_class._on_draw = on_draw_then_dali

    def stop() -> None:
        if generator_class._on_draw is on_draw_then_dali:
            generator_class._on_draw = captured

    return stop


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


#: the module of DALI's dynamic-mode operators, whose ``Operator._run`` runs each of them
_OPS_FILE = os.path.join("dynamic", "_ops.py")


def failed_operator(error: BaseException) -> str | None:
    """The DALI operator an eagerly run step failed in, as DALI's own errors name one (``CPU
    operator decoders.Image``); None when no operator of DALI's is in the error's tracebacks.

    DALI 2.4 words an eager failure as "An error happened during asynchronous execution" raised
    from the operator's own error, and names no operator; the traceback of that outer error
    still runs through the failed operator's ``_run`` (in ``dynamic/_ops.py``), whose ``self``
    is the operator. The innermost such frame, over the error and its causes, is the one."""
    found: Any = None
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        frames = current.__traceback__
        while frames is not None:
            frame = frames.tb_frame
            if frame.f_code.co_filename.endswith(_OPS_FILE) and frame.f_code.co_name == "_run":
                operator = frame.f_locals.get("self")
                if isinstance(getattr(operator, "_schema_name", None), str):
                    found = operator
            frames = frames.tb_next
        current = current.__cause__
    if found is None:
        return None
    name = str(found._schema_name).replace("__", ".")
    backend = str(getattr(found, "_backend", "") or "")
    kind = {"cpu": "CPU", "gpu": "GPU", "mixed": "Mixed"}.get(backend, backend)
    return f"{kind} operator {name}" if kind else f"operator {name}"


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


def context_stream(ctx: Any) -> int:
    """The CUDA stream handle of the worker's EvalContext (DALI's work for it is ordered on
    that stream). Raises when it has none: copying on an unordered stream would race DALI."""
    stream = ctx.cuda_stream
    handle = getattr(stream, "handle", None)
    if handle is None:
        raise RuntimeError(
            f"the worker's EvalContext (device_id={ctx.device_id}) has no CUDA stream, so GPU "
            "batches cannot be copied in order; check that device='gpu' sees a GPU"
        )
    return int(handle)


def to_device(batch: Any, device: str, device_id: int | None) -> Any:
    """``batch`` on the worker's device (``device_id`` for GPU, never the current device)."""
    if batch_device(batch) == device:
        return batch
    return batch.gpu(device_id) if device == "gpu" else batch.cpu()


def copy_packed(storage: Any, address: int, stream: int | None) -> None:
    """Copy every sample of a batch back to back to ``address``, in one call.

    A CPU batch goes to host memory. A GPU batch goes to device memory on ``stream``, blocking the
    worker's host thread: DALI may reuse a pipeline's output buffer on its next run, so the copy
    must be done before the loop goes on (the trainer never waits on the host).
    """
    if stream is None:
        storage.copy_to_external(ctypes.c_void_p(address))
        return
    storage.copy_to_external(
        ctypes.c_void_p(address), cuda_stream=ctypes.c_void_p(stream), non_blocking=False
    )
