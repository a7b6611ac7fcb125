"""Configuration: the loader's settings and the place it runs in. The bottom layer of the trainer
side.

Owns: :class:`~loader.config._config.LoaderConfig` (every setting, checked once, frozen), the
``num_workers="auto"`` policy (:mod:`._autotune`: it decides, it measures nothing), the machine
and the placement (:mod:`._env`: CPUs, memory, rank discovery), the checks of the user's
functions (:mod:`._validate`) and the ``torch.distributed`` helpers (:mod:`._distributed`).

May import: ``loader._errors``, ``workers``, ``ipc``. Nothing above it.
"""
