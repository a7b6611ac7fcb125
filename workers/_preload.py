"""Imported once by multiprocessing's own forkserver before it forks any worker, where the
loader's worker server cannot run (``loader._server``): DALI and the worker's modules, without
importing torch on the way (:mod:`workers._imports`)."""

from ._imports import import_dali_modules

import_dali_modules()
