"""Configuration: the loader's settings and the place it runs in. The bottom layer of the trainer
side.

Owns: :class:`~loader.config._config.LoaderConfig` (every setting, checked once, frozen), the
``num_workers="auto"`` policy (:mod:`._autotune`: it decides, it measures nothing), the machine
and the placement (:mod:`._env`: CPUs, memory, rank discovery), the checks of the user's
functions (:mod:`._validate`) and the ``torch.distributed`` helpers (:mod:`.distributed`).

May import: ``loader.errors``, ``workers``, ``ipc``. Nothing above it.
"""

from . import distributed
from ._autotune import (
    SETTLED_EVERY,
    Autotuner,
    AutotuneReport,
    Decision,
    Layout,
    Measurement,
    combine,
)
from ._config import (
    START_METHOD_ENV,
    LoaderConfig,
    check_start_method,
    default_start_method,
    set_default_start_method,
)
from ._env import (
    OVERSUBSCRIBE,
    host_facts,
    local_ranks,
    node_shares,
    package_version,
    settle_placement,
    worker_budget,
)
from ._validate import died_early_hint, main_file

__all__ = [
    "OVERSUBSCRIBE",
    "SETTLED_EVERY",
    "START_METHOD_ENV",
    "AutotuneReport",
    "Autotuner",
    "Decision",
    "Layout",
    "LoaderConfig",
    "Measurement",
    "check_start_method",
    "combine",
    "default_start_method",
    "died_early_hint",
    "distributed",
    "host_facts",
    "local_ranks",
    "main_file",
    "node_shares",
    "package_version",
    "set_default_start_method",
    "settle_placement",
    "worker_budget",
]
