"""``LoaderConfig``: the Loader's arguments, validated once. Runs in the trainer.

Everything derived from the constructor's arguments is computed here, once: the worker specs and
the payload every rank must agree on come from this object, never from copied fields.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from workers import Definition, Shard, WorkerSpec, check_storage_libraries

from . import _env
from ._autotune import Layout
from ._keywords import checked_keywords, keyword
from ._validate import (
    check_choice,
    check_count,
    check_definition,
    check_flag,
    check_importable,
    check_not_importing_main,
    check_positive_int,
    check_seconds,
    check_seed,
    check_trace_path,
    named_urls,
    optional,
)

OUTPUTS = ("numpy", "torch", "cupy")
DEVICES = ("cpu", "gpu")
START_METHODS = ("spawn", "forkserver")
#: The start method of a Loader made without ``start_method``, when set ("forkserver" when unset).
START_METHOD_ENV = "DALI_LOADER_START_METHOD"
#: Workers forked from this process's worker server (loader.processes.server); "spawn" starts each
#: worker
#: as a fresh interpreter that imports DALI and the main module itself.
DEFAULT_START_METHOD = "forkserver"
#: This process's default, set by :func:`set_default_start_method` (the pytest plugin's worker
#: server: unlike the environment variable, subprocesses a test starts do not inherit it).
_process_default: str | None = None


def default_start_method() -> str | None:
    """This process's default start method (:func:`set_default_start_method`; None: unset)."""
    return _process_default


def set_default_start_method(method: str | None) -> str | None:
    """Make ``method`` the start method of Loaders this process makes without ``start_method``
    (None: back to :data:`START_METHOD_ENV` or "forkserver"); returns the previous setting."""
    global _process_default
    if method is not None:
        check_choice(method, "start_method", START_METHODS)
    previous, _process_default = _process_default, method
    return previous


def _start_method(value: Any, name: str) -> str:
    return check_start_method(value)


_ON_ERROR = ("raise", "skip")


@dataclass(frozen=True, kw_only=True)
class LoaderConfig:
    """Every argument of :class:`loader.Loader`, checked, plus what follows from them.

    The fields made with :func:`keyword` are the Loader's parameters, in its signature's order:
    the default of each is the Loader's, its check is beside it (a unit test keeps
    ``Loader.__init__`` equal to them). Once built, some hold what their argument settled:
    ``num_workers`` and ``num_threads`` counts (0 while "auto" has not chosen), ``device_id``,
    ``start_method``, ``rank`` and ``world_size`` as found, ``memory_limit`` in bytes.
    """

    # source, step and feeders: checked together (_check_functions); keyword() is a
    # dataclasses.field, whatever the annotation (RUF009 cannot tell)
    #: a dataset definition (opened in each worker with ``batch_size``) or ``source(shard)``
    source: Definition | Callable[[Shard], Any] = keyword(positional=True)  # noqa: RUF009
    step: Callable[..., Any] = keyword(positional=True)  # noqa: RUF009
    batch_size: int = keyword(check=check_positive_int)
    #: with num_workers/num_threads="auto", 0 until the run's layout plan decides them
    num_workers: int = keyword(2, check=check_count)
    feeders: Callable[[Shard], Mapping[str, Any]] | None = keyword(None)  # noqa: RUF009
    device: str = keyword("cpu", check=functools.partial(check_choice, choices=DEVICES))
    device_id: int | None = keyword(None)  # checked with device and the placement
    num_threads: int = keyword(None, check=optional(check_count))
    prefetch: int = keyword(2, check=check_positive_int)
    output: str = keyword("numpy", check=functools.partial(check_choice, choices=OUTPUTS))
    copy: bool = keyword(False, check=check_flag)
    capture: bool = keyword(True, check=check_flag)
    seed: int = keyword(0, check=check_seed)
    timeout: float | None = keyword(None, check=functools.partial(check_seconds, optional=True))
    start_method: str = keyword(None, check=_start_method)
    rank: int = keyword(None)  # rank and world_size: the placement discovered (_env)
    world_size: int = keyword(None)
    startup_timeout: float = keyword(300.0, check=functools.partial(check_seconds, optional=False))
    shm_limit: int | None = keyword(None, check=optional(check_positive_int))
    max_restarts: int = keyword(0, check=functools.partial(check_positive_int, minimum=0))
    on_error: str = keyword("raise", check=functools.partial(check_choice, choices=_ON_ERROR))
    max_skipped: int | None = keyword(
        None, check=optional(functools.partial(check_positive_int, minimum=0))
    )
    in_order: bool = keyword(True, check=check_flag)
    #: the batches that end a rank's epoch come cut to their real rows (no padding)
    cut_padding: bool = keyword(False, check=check_flag)
    #: (on_error="skip") the row a skipped sample leaves is cut off its batch, not filled with
    #: a flagged repeat of another row: no batch holds a sample twice
    cut_replaced: bool = keyword(True, check=check_flag)
    trace: str | None = keyword(None, check=check_trace_path)  # where close() writes the trace
    #: bytes this rank's workers may hold (with "auto"), checked with num_workers and num_threads
    memory_limit: int | None = keyword(None)

    # what follows from them
    local_world_size: int = 1
    #: how rank and world size were found (see ``_env.Placement.source``)
    placement_source: str = "arguments"
    num_threads_given: bool = True  # False: num_threads follows the placement
    #: num_workers="auto" / num_threads="auto": the loader chooses them (see
    #: loader.config._autotune)
    workers_auto: bool = False
    threads_auto: bool = False
    cpus: int = 1  # the CPUs this rank's workers share (affinity / local ranks and xdist peers)
    first_epoch: int = 0  # workers started later (a new layout) build their sources for it

    @classmethod
    def build(
        cls,
        source: Definition | Callable[[Shard], Any],
        step: Callable[..., Any],
        **given: Any,
    ) -> LoaderConfig:
        """Validate the Loader's arguments (``TypeError``/``ValueError`` that say what to
        change; a keyword not given takes its field's default) and discover rank, GPU and
        thread budget. What ``"auto"`` tunes stays 0: the run's layout plan
        (:mod:`loader.run._layout`) decides every layout, the first included."""
        check_not_importing_main()
        # each value through its own check, in the signature's order; then the joint checks
        checked = cls(**checked_keywords(cls, {"source": source, "step": step, **given}))
        _check_output(checked.device, checked.output)
        _check_functions(checked.source, checked.step, checked.feeders)
        placement = _env.discover_placement(checked.rank, checked.world_size)
        device_id = _check_device(checked.device, checked.output, checked.device_id, placement)
        workers_auto, threads_auto = _is_auto(checked.num_workers), _is_auto(checked.num_threads)
        num_workers, num_threads, memory_limit = _layout_fields(
            checked.num_workers,
            checked.num_threads,
            checked.memory_limit,
            placement.local_world_size,
        )
        return dataclasses.replace(
            checked,
            num_workers=num_workers,
            device_id=device_id,
            num_threads=num_threads,
            rank=placement.rank,
            world_size=placement.world_size,
            memory_limit=memory_limit,
            local_world_size=placement.local_world_size,
            placement_source=placement.source,
            num_threads_given=checked.num_threads is not None and not threads_auto,
            workers_auto=workers_auto,
            threads_auto=threads_auto,
            cpus=_env.cpu_budget(placement.local_world_size),
        )

    @property
    def placement(self) -> _env.Placement:
        return _env.Placement(
            self.rank, self.world_size, 0, self.local_world_size, self.placement_source
        )

    def placed(self, placement: _env.Placement) -> LoaderConfig:
        """This configuration at another rank and world size (a settled placement)."""
        num_threads = self.num_threads
        if not (self.num_threads_given or self.workers_auto or self.threads_auto):
            num_threads = _env.default_num_threads(self.num_workers, placement.local_world_size)
        return dataclasses.replace(
            self,
            rank=placement.rank,
            world_size=placement.world_size,
            local_world_size=placement.local_world_size,
            placement_source=placement.source,
            num_threads=num_threads,
            cpus=_env.cpu_budget(placement.local_world_size),
        )

    def with_layout(self, layout: Layout, first_epoch: int = 0) -> LoaderConfig:
        """This configuration with another number of workers and DALI threads each, whose
        workers start with ``first_epoch`` (not epoch 0's order)."""
        return dataclasses.replace(
            self, num_workers=layout.workers, num_threads=layout.threads, first_epoch=first_epoch
        )

    @property
    def layout(self) -> Layout:
        return Layout(self.num_workers, self.num_threads)

    @property
    def num_slots(self) -> int:
        """Slots per worker: ``prefetch`` ahead, one in the user's hands, one spare."""
        return self.prefetch + 2

    @functools.cached_property
    def shards(self) -> tuple[Shard, ...]:
        """This rank's shards, one per worker."""
        return tuple(
            Shard.make(
                rank=self.rank,
                world_size=self.world_size,
                worker=worker,
                num_workers=self.num_workers,
                seed=self.seed,
            ).for_epoch(self.first_epoch)
            for worker in range(self.num_workers)
        )

    def worker_specs(self) -> list[WorkerSpec]:
        """What each worker is told at spawn time."""
        on_main_thread = threading.current_thread() is threading.main_thread()
        together = uuid.uuid4().hex
        return [
            WorkerSpec(
                source=self.source,
                step=self.step,
                feeders=self.feeders,
                shard=shard,
                batch_size=self.batch_size,
                capture=self.capture,
                device=self.device,
                device_id=self.device_id,
                num_threads=self.num_threads,
                num_slots=self.num_slots,
                parent_pid=os.getpid(),
                parent_death_signal=on_main_thread,
                log_level=logging.getLogger("loader").getEffectiveLevel(),
                shm_limit=self.shm_limit,
                on_error=self.on_error,
                started_together=together,
            )
            for shard in self.shards
        ]

    def agreement_payload(self) -> dict[str, Any]:
        """What every rank must have in common (rank, world size and the GPU are per rank)."""
        # a default thread count follows each machine's CPUs: only a given one must agree
        return {
            "batch_size": self.batch_size,
            "num_workers": "auto" if self.workers_auto else self.num_workers,
            "seed": self.seed,
            "capture": self.capture,
            "device": self.device,
            "num_threads": "auto"
            if self.threads_auto
            else self.num_threads
            if self.num_threads_given
            else "default",
            "prefetch": self.prefetch,
            "output": self.output,
            "on_error": self.on_error,
        }


def _layout_fields(
    num_workers: int | str, num_threads: Any, memory_limit: Any, local_world_size: int
) -> tuple[int, int, int | None]:
    """The validated ``num_workers`` (0 for "auto"), ``num_threads`` (its default for the
    workers and local ranks when not given; 0 for "auto", or with ``num_workers="auto"`` when
    not given) and the memory budget of what "auto" tunes. What is tuned stays 0 here: the
    run's layout plan (loader.run._layout) decides checked."""
    if _is_auto(num_workers) or _is_auto(num_threads):
        workers = 0 if _is_auto(num_workers) else int(num_workers)
        threads = num_threads if isinstance(num_threads, int) else 0
        return workers, threads, _env.memory_budget(memory_limit, local_world_size)
    if memory_limit is not None:
        raise ValueError(
            "memory_limit= is the memory budget of num_workers='auto' or "
            "num_threads='auto'; drop it, or pass num_workers='auto'"
        )
    workers = int(num_workers)
    if isinstance(num_threads, int):
        return workers, num_threads, None
    return workers, _env.default_num_threads(workers, local_world_size), None


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == "auto"


def _require_module(name: str, message: str) -> None:
    import importlib

    try:
        importlib.import_module(name)
    except ImportError as error:
        raise ImportError(message) from error


def check_start_method(start_method: Any) -> str:
    """The start method a Loader made with ``start_method`` uses (None: the process's
    default, then :data:`START_METHOD_ENV`, then "forkserver")."""
    if start_method is None:
        if _process_default is not None:
            return _process_default
        chosen = os.environ.get(START_METHOD_ENV, "") or DEFAULT_START_METHOD
        if chosen not in START_METHODS:
            raise ValueError(
                f"{START_METHOD_ENV}={chosen!r}: set it to 'spawn' or 'forkserver' (or unset "
                "it), or pass start_method= to the Loader"
            )
        return chosen
    if start_method == "fork":
        raise ValueError(
            "start_method='fork' is refused: a process forked after DALI ran hangs on its "
            "first operator. Use 'forkserver' (the default: workers forked from a worker server "
            "that never ran DALI) or 'spawn'"
        )
    return check_choice(start_method, "start_method", START_METHODS)


def require_gpu() -> int:
    """The number of GPUs CUDA can see; raises a clear error when there is none."""
    import ctypes

    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        count = ctypes.c_int(0)
        if libcuda.cuInit(0) != 0 or libcuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
            raise OSError("cuInit failed")
    except OSError:
        raise RuntimeError(
            "device='gpu' needs an NVIDIA GPU and its driver, and none was found "
            "(check nvidia-smi and CUDA_VISIBLE_DEVICES); use device='cpu'"
        ) from None
    if count.value < 1:
        raise RuntimeError(
            "device='gpu' needs an NVIDIA GPU, but CUDA sees none "
            "(check CUDA_VISIBLE_DEVICES); use device='cpu'"
        )
    return int(count.value)


def _check_output(device: str, output: str) -> None:
    """The output library must hold batches where ``device`` makes them."""
    if device == "gpu" and output == "numpy":
        raise ValueError(
            "device='gpu' delivers batches in GPU memory: pass output='torch' or "
            "output='cupy' (or use device='cpu' for numpy arrays)"
        )
    if device == "cpu" and output == "cupy":
        raise ValueError("output='cupy' needs device='gpu'")


def _check_functions(source: Any, step: Any, feeders: Any) -> None:
    """``source`` (unless a dataset definition, which must pickle), ``step`` and ``feeders``
    must be importable by name in a spawned worker."""
    if isinstance(source, Definition):
        check_definition(source, "source")
    elif not callable(source):
        raise TypeError(
            "source must be a dataset definition (FilesDataset, TarsDataset, SamplesDataset, "
            f"MixDataset) or a function source(shard), got {type(source).__name__}"
        )
    else:
        check_importable(source, "source")
    check_importable(step, "step")
    # (a storage library missing or too old: said once here, not by every worker)
    check_storage_libraries(named_urls(source))
    if feeders is not None:
        if isinstance(feeders, Mapping):
            raise TypeError(
                "feeders must be a module-level function feeders(shard) -> {name: "
                "ndd.ExternalSource}, not a dict of instances: every worker loop needs its "
                "own feeders (rule 4c), so the loader builds them in each worker"
            )
        check_importable(feeders, "feeders")


def _check_device(device: str, output: str, device_id: Any, placement: _env.Placement) -> Any:
    """The libraries ``device`` and ``output`` need, and the GPU (``device_id``) to use."""
    if output == "torch":
        _require_module(
            "torch", "output='torch' needs PyTorch: pip install 'dali-capture-loader[torch]'"
        )
    if output == "cupy":
        _require_module("cupy", "output='cupy' needs CuPy: pip install 'dali-capture-loader[gpu]'")
    if device == "gpu":
        visible = require_gpu()
        # the CUDA slot ring is CuPy's, whatever the output library
        _require_module("cupy", "device='gpu' needs CuPy: pip install 'dali-capture-loader[gpu]'")
        if device_id is None:
            device_id = _env.default_device_id(placement, visible)
    elif device_id is not None:
        raise ValueError("device_id= is only meaningful with device='gpu'")
    return device_id
