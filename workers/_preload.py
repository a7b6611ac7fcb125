"""Imported once by a forkserver before it forks any worker: DALI and the worker's modules,
without importing torch on the way (:mod:`workers._imports`)."""

from ._imports import import_dali_modules

import_dali_modules()
