"""Argument checks made in the trainer before any worker starts."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import io
import math
import os
import pickle
import re
import sys
import types
from collections.abc import Callable
from typing import Any

#: Added to the error of a worker that died before it could report anything (exit code 1).
MAIN_GUARD_HINT = (
    "it died before it could report anything, so its Python traceback is on its stderr (above). "
    "A worker starts by importing the trainer's main module: code that runs a Loader or a "
    'training job at import time belongs under `if __name__ == "__main__":`'
)
#: The same, for a trainer whose main module has no file (its workers do not import it).
NO_MAIN_FILE_HINT = (
    "it died before it could report anything, so its Python traceback is on its stderr (above)"
)


def main_file() -> str | None:
    """The file of the trainer's main module, which a new process (the worker server, a
    spawned worker) runs again as ``__mp_main__``; None when it has none: ``python -c``, a REPL
    or a notebook (no ``__file__``), or a script Python read from standard input (``python -``,
    a pipe, a heredoc: ``__file__`` is ``"<stdin>"``, a name, not a file; its text is gone)."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if not isinstance(path, str) or not path or (path.startswith("<") and path.endswith(">")):
        return None
    return os.path.abspath(path)


def died_early_hint() -> str:
    """What to add to the error of a worker that died before it could report anything."""
    return MAIN_GUARD_HINT if main_file() is not None else NO_MAIN_FILE_HINT


def _where_main_is(main: object) -> str:
    """How the trainer's main module, which has no file, was given to Python."""
    if getattr(main, "__file__", None) == "<stdin>":
        return "a script read from standard input (`python -`, a pipe or a heredoc)"
    if sys.argv[:1] == ["-c"]:
        return "code given with `python -c`"
    return "an interactive session (REPL or notebook)"


def _unimportable_main(subject: str, name: str) -> str:
    """The refusal of ``subject`` (``"step (step)"``, or ``"..., which"`` of what a partial's
    arguments refer to), named ``name``, defined in a main module that has no file."""
    where = _where_main_is(sys.modules.get("__main__"))
    if where.startswith("an interactive"):
        return (
            f"{subject} is defined in {where}; spawned workers cannot import it. Put it in a .py "
            "file and import it"
        )
    return (
        f"{subject} is defined in {where}; workers cannot import it: they find the trainer's "
        "functions by importing its main module again from its file, and this one has none. "
        f"Save the script to a file and run it as `python train.py`, or move {name} to a "
        "module that the script imports"
    )


class _MainReferences(pickle.Pickler):
    """Pickles into a buffer that is dropped, noting the classes and functions of ``__main__``
    it meets (saved by reference: a worker looks them up in its own ``__main__``)."""

    def __init__(self) -> None:
        super().__init__(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL)
        self.found: list[str] = []

    def persistent_id(self, obj: Any) -> None:
        if (
            isinstance(obj, (type, types.FunctionType))
            and getattr(obj, "__module__", None) == "__main__"
        ):
            self.found.append(getattr(obj, "__qualname__", repr(obj)))
        return None


def _check_pickles(fn: Any, what: str, name: str, *, partial: bool) -> None:
    """``fn`` pickles, and names nothing of a main module that workers cannot import."""
    references = _MainReferences()
    try:
        references.dump(fn)
    except Exception as error:
        if partial:
            raise TypeError(
                f"{what}: the arguments of this partial cannot be pickled: {error}"
            ) from error
        raise TypeError(f"{what} ({name}) cannot be sent to a worker: {error}") from error
    if references.found and main_file() is None:
        names = ", ".join(dict.fromkeys(references.found))
        whose = f"{what}: the arguments of this partial" if partial else f"{what} ({name})"
        raise TypeError(_unimportable_main(f"{whose} refer to {names}, which", names))


def check_definition(definition: Any, what: str) -> None:
    """A dataset definition (``FilesDataset(root)``...) travels to each worker pickled, by
    value: refuse one that does not pickle, or that refers to functions of a main module that
    workers cannot import (a ``SamplesDataset``'s ``load`` defined in ``python -c``)."""
    kind = type(definition).__name__
    references = _MainReferences()
    try:
        references.dump(definition)
    except Exception as error:
        raise TypeError(
            f"{what} ({kind}) cannot be sent to a worker: {error}; what it holds must pickle "
            "(a load function defined with `def` at module level, not a lambda or a nested "
            "function)"
        ) from error
    if references.found and main_file() is None:
        names = ", ".join(dict.fromkeys(references.found))
        raise TypeError(_unimportable_main(f"{what} ({kind}) refers to {names}, which", names))


def check_not_importing_main() -> None:
    """Refuse a Loader made while a new process imports the trainer's main module.

    A worker, or the worker server, imports the main module (as ``__mp_main__``, code under
    ``if __name__ == "__main__":`` skipped) to find ``source`` and ``step``. A script that makes
    its Loader at module level would make one there too: each worker would try to start workers
    of its own. Seen from the stack: the body of a module named ``__mp_main__`` is running."""
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__mp_main__":
            raise RuntimeError(
                "Loader(...) was called while a new process (a loader worker) was importing the "
                "trainer's main module: the code that makes the Loader runs at import time. Put "
                'it under `if __name__ == "__main__":` (or in a function that block calls)'
            )
        frame = frame.f_back


def check_importable(fn: Any, what: str) -> None:
    """Spawned workers import ``fn`` by module and name; refuse what they could not import.

    A ``functools.partial`` of an importable function is accepted when its arguments pickle.
    """
    if isinstance(fn, functools.partial):
        check_importable(fn.func, what)
        _check_pickles(fn, what, repr(fn), partial=True)
        return
    if not callable(fn):
        raise TypeError(f"{what} must be a function, got {type(fn).__name__}")
    if _is_external_source_instance(fn):
        raise TypeError(
            f"{what} is an ndd.ExternalSource instance; pass a module-level function that "
            "builds one per worker (two workers cannot share one source)"
        )
    qualname = getattr(fn, "__qualname__", "")
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__name__", repr(fn))
    if "<lambda>" in qualname:
        raise TypeError(
            f"{what} is a lambda; workers are spawned and import it by name, so define it "
            "with `def` at module level"
        )
    if "<locals>" in qualname:
        raise TypeError(
            f"{what} ({qualname}) is defined inside a function; spawned workers can only import "
            "module-level functions, so move it to module level"
        )
    if module is None:
        raise TypeError(f"{what} ({name}) has no module; define it at module level in a file")
    if module == "__main__":
        if main_file() is None:
            raise TypeError(_unimportable_main(f"{what} ({name})", name))
    else:
        try:
            imported = importlib.import_module(module)
        except ImportError as error:
            raise TypeError(f"{what} ({name}): module {module!r} cannot be imported") from error
        target: Any = imported
        for part in qualname.split("."):
            target = getattr(target, part, None)
        if target is not fn:
            raise TypeError(
                f"{what} ({module}.{qualname}) is not reachable by its name in its module; "
                "define it at module level"
            )
    _check_pickles(fn, what, name, partial=False)


def _is_external_source_instance(obj: object) -> bool:
    module = type(obj).__module__
    return module.startswith("nvidia.dali") and type(obj).__name__ == "ExternalSource"


def check_positive_int(value: Any, name: str, *, minimum: int = 1) -> int:
    """``value`` as an int ``>= minimum``: a float (even 2.0) is a ``ValueError``, another type
    a ``TypeError``."""
    if isinstance(value, float):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_choice(value: Any, name: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return str(value)


def check_int(value: Any, name: str) -> int:
    """An ``int`` (not a ``bool``)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return value


def check_seed(value: Any, name: str) -> int:
    """An ``int`` >= 0: each shard seeds its draws with it plus its index (numpy's and DALI's
    generators take no negative seed; one failed in every worker's source, not naming it)."""
    seed = check_int(value, name)
    if seed < 0:
        raise ValueError(
            f"{name} must be >= 0 (each shard draws with {name} + its index), got {seed}"
        )
    return seed


def check_flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def check_count(value: Any, name: str) -> int | str:
    """A positive int or ``"auto"``, or a clear error that also names "auto"."""
    if isinstance(value, str):
        if value == "auto":
            return value
        raise ValueError(f"{name} must be a positive int or 'auto', got {value!r}")
    try:
        return check_positive_int(value, name)
    except TypeError:
        raise TypeError(
            f"{name} must be a positive int or 'auto', got {type(value).__name__} ({value!r})"
        ) from None


def check_seconds(value: Any, name: str, *, optional: bool) -> float | None:
    """A positive, finite number of seconds (or None when ``optional``)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__}")
    if not (value > 0 and math.isfinite(value)):
        hint = " or None" if optional else ""
        raise ValueError(f"{name} must be a positive number of seconds{hint}, got {value}")
    return float(value)


def check_trace_path(path: Any, name: str = "trace") -> str | None:
    """A file path whose folder exists (or None)."""
    if path is None:
        return None
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{name} must be a file path (str or Path), got {type(path).__name__}")
    text = os.fspath(path)
    if not isinstance(text, str) or not text:
        raise ValueError(f"{name} must name a file, for example {name}='loader-trace.json'")
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise ValueError(f"{name}={text!r}: the folder {folder!r} does not exist; create it first")
    if os.path.isdir(text):
        raise ValueError(f"{name}={text!r} is a folder; name a file in it")
    return text


def optional(check: Callable[[Any, str], Any]) -> Callable[[Any, str], Any]:
    """``check``, with None let through."""

    def check_unless_none(value: Any, name: str) -> Any:
        return None if value is None else check(value, name)

    return check_unless_none


#: How far :func:`named_urls` looks: calls into functions, items of a list.
_URL_DEPTH = 3
_URL_ITEMS = 64
#: A URL: ``<protocol>://<path>``, no white space.
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://\S+\Z")
_OWN_PACKAGES = frozenset({"loader", "workers", "ipc"})


def named_urls(source: Any) -> list[str]:
    """The URLs (``s3://...``; not local paths) that ``source`` names where the trainer can see
    them without running it: a definition's fields, a ``functools.partial``'s arguments, the
    string constants of a function's code and the module globals it reads (those of the
    functions it calls, a few levels down). What only a worker computes is not seen (the worker
    then checks what it opens)."""
    found: dict[str, None] = {}
    seen: set[int] = set()

    def look(value: Any, depth: int) -> None:
        if isinstance(value, str):
            if _URL.match(value) and not value.startswith("file://"):
                found.setdefault(value)
            return
        if depth > _URL_DEPTH or id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, functools.partial):
            for item in (value.func, *value.args, *value.keywords.values()):
                look(item, depth + 1)
        elif isinstance(value, (list, tuple, set, frozenset)):
            for item in list(value)[:_URL_ITEMS]:
                look(item, depth + 1)
        elif isinstance(value, dict):
            for item in list(value.values())[:_URL_ITEMS]:
                look(item, depth + 1)
        elif isinstance(value, types.FunctionType):
            if str(getattr(value, "__module__", "")).partition(".")[0] in _OWN_PACKAGES:
                return  # (the loader's own functions name no dataset)
            code(value.__code__, value.__globals__, depth)
            for cell in value.__closure__ or ():
                with contextlib.suppress(ValueError):  # (an empty cell)
                    look(cell.cell_contents, depth + 1)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for field in dataclasses.fields(value):
                look(getattr(value, field.name, None), depth + 1)

    def code(body: types.CodeType, namespace: dict[str, Any], depth: int) -> None:
        for constant in body.co_consts:
            if isinstance(constant, types.CodeType):
                code(constant, namespace, depth)
            else:
                look(constant, depth + 1)
        for name in body.co_names:
            value = namespace.get(name)
            if isinstance(value, (str, list, tuple, types.FunctionType, functools.partial)):
                look(value, depth + 1)

    look(source, 0)
    return list(found)
