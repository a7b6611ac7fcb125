"""``from loader import ndd``: DALI's dynamic mode, imported on first use.

Runs in the trainer and in the workers (a ``source``'s or ``step``'s module imports it in both).
``ndd`` is a module object that stands for ``nvidia.dali.experimental.dynamic``: the first
lookup of one of its attributes (``ndd.decoders``, ``ndd.readers.File``, ``ndd.float32``)
imports DALI's module and copies its namespace into ``ndd``, which from then on *is* that
namespace: the same functions, classes, submodules and constants, found by plain attribute
lookup. Only the workers call operators, so a trainer whose scripts name DALI only through
``ndd`` never imports DALI (nor the torch import that DALI's own import brings).

Why not ``importlib.util.LazyLoader``: DALI's package replaces its module in ``sys.modules``
while it loads, which LazyLoader refuses (``module object ... substituted in sys.modules during a
lazy load``). Why a copied namespace and not only ``__getattr__``: DALI's capture reads the
functions that call operators without running user code, resolving a name such as
``ndd.float32`` with :func:`inspect.getattr_static`, which sees a module's ``__dict__`` and
never its ``__getattr__``; it accepts such a name as a constant when the module it starts from
is named ``nvidia.dali...``. ``ndd`` has DALI's module name from the start, and the copied
namespace, so the capture analyses ``ndd.resize(x, dtype=ndd.float32)`` exactly as it does
after ``import nvidia.dali.experimental.dynamic as ndd``.

Looking up a dunder name (``__file__``, ``__wrapped__``, ...) before the import does not import
DALI (tools probe those on any object); ``dir(ndd)``, setting and deleting an attribute do. A
name DALI adds to its module later (a plugin's operators) is found through ``__getattr__`` and
copied then. Part of the public face; imports nothing of ours.
"""

from __future__ import annotations

import importlib
import threading
import types
from typing import Any

#: The module that ``ndd`` stands for.
TARGET = "nvidia.dali.experimental.dynamic"


class LazyModule(types.ModuleType):
    """A module that imports ``target`` on the first lookup of one of its attributes and then
    holds that module's namespace (see the module's docstring)."""

    __slots__ = ("_lazy_lock", "_lazy_module")

    def __init__(self, target: str) -> None:
        super().__init__(target)
        object.__setattr__(self, "_lazy_lock", threading.Lock())
        object.__setattr__(self, "_lazy_module", None)

    # Only dunder methods here: any other name of the class would hide the target's own.

    def __getattr__(self, name: str) -> Any:
        # Called only for a name not in the namespace: before the import, or one the target
        # module gained after it.
        if name.startswith("__") and name.endswith("__") and not is_imported(self):
            raise AttributeError(f"module {self.__name__!r} (not imported yet) has no {name!r}")
        value = getattr(load(self), name)
        self.__dict__[name] = value
        return value

    def __dir__(self) -> list[str]:
        return dir(load(self))

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(load(self), name, value)
        self.__dict__[name] = value

    def __delattr__(self, name: str) -> None:
        delattr(load(self), name)
        self.__dict__.pop(name, None)

    def __repr__(self) -> str:
        if is_imported(self):
            return f"<module {self.__name__!r} (loader.ndd, imported)>"
        return f"<module {self.__name__!r} (loader.ndd, imported on first use)>"


def is_imported(module: LazyModule) -> bool:
    """Whether ``module``'s target was imported through it (in this process)."""
    return object.__getattribute__(module, "_lazy_module") is not None


def load(module: LazyModule) -> types.ModuleType:
    """``module``'s target, imported (and its namespace copied into ``module``) the first time."""
    target: types.ModuleType | None = object.__getattribute__(module, "_lazy_module")
    if target is not None:
        return target
    with object.__getattribute__(module, "_lazy_lock"):
        target = object.__getattribute__(module, "_lazy_module")
        if target is None:
            target = importlib.import_module(module.__name__)
            module.__dict__.update(target.__dict__)
            object.__setattr__(module, "_lazy_module", target)
    return target


#: DALI's dynamic mode, imported on first use: ``from loader import ndd``.
ndd = LazyModule(TARGET)
