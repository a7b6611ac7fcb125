"""``from loader import ndd``: imported on first use, then DALI's own namespace, and DALI's
capture reads a function that names DALI through it as one that imports DALI directly."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path
from typing import Any

import nvidia.dali.experimental.dynamic as real
import pytest
from nvidia.dali.experimental.dynamic import _source_analysis

from loader._ndd import TARGET, LazyModule, is_imported

ROOT = Path(__file__).resolve().parents[3]

#: A fresh one for the capture's probe below (the package's own ``ndd`` may be imported already).
lazy = LazyModule(TARGET)


def test_importing_the_package_and_probing_ndd_imports_no_dali() -> None:
    code = (
        "import inspect, sys\n"
        "import loader\n"
        "from loader import ndd\n"
        "assert inspect.ismodule(ndd) and ndd.__name__ == 'nvidia.dali.experimental.dynamic'\n"
        "assert not hasattr(ndd, '__wrapped__') and 'imported on first use' in repr(ndd)\n"
        "print(sorted(m for m in sys.modules if m.startswith('nvidia')))\n"
        "ndd.readers\n"
        "print('nvidia.dali.experimental.dynamic' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["[]", "True"]


def test_after_the_first_lookup_it_holds_dalis_namespace() -> None:
    module = LazyModule(TARGET)
    assert module.readers is real.readers
    assert is_imported(module)
    assert module.decoders.image is real.decoders.image
    assert module.random.coin_flip is real.random.coin_flip
    assert module.Batch is real.Batch and isinstance(real.as_batch([[1], [2]]), module.Batch)
    # what DALI's capture sees without running code: the namespace, not __getattr__
    assert inspect.getattr_static(module, "float32") is real.float32
    assert inspect.getattr_static(module, "resize") is real.resize
    assert module.__file__ == real.__file__ and set(dir(module)) == set(dir(real))


def test_the_class_hides_no_name_of_the_target() -> None:
    """Only dunders and its two slots: any other name would shadow one of DALI's."""
    names = {name for name in vars(LazyModule) if not name.startswith("__")}
    assert names == {"_lazy_lock", "_lazy_module"}
    assert not names & set(vars(real))


def test_dunders_do_not_import_and_names_added_later_are_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "lazy_probe_target.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = LazyModule("lazy_probe_target")
    assert not hasattr(module, "__wrapped__") and not hasattr(module, "__file__")
    assert "lazy_probe_target" not in sys.modules and not is_imported(module)
    assert module.VALUE == 1
    target = sys.modules.pop("lazy_probe_target")
    assert module.__file__ == str(tmp_path / "lazy_probe_target.py")
    target.LATER = 2  # a name the module gains after the import (a plugin's operators)
    assert module.LATER == 2 and inspect.getattr_static(module, "LATER") == 2
    with pytest.raises(AttributeError, match="MISSING"):
        module.MISSING  # noqa: B018


def test_setting_and_deleting_reach_the_target(monkeypatch: pytest.MonkeyPatch) -> None:
    module = LazyModule(TARGET)
    monkeypatch.setattr(module, "loader_test_marker", 7, raising=False)
    assert real.loader_test_marker == 7 and module.loader_test_marker == 7  # type: ignore[attr-defined]
    monkeypatch.undo()
    assert not hasattr(real, "loader_test_marker") and not hasattr(module, "loader_test_marker")


# DALI's capture decides, at an operator's call site, which arguments are constants; a DALI
# constant (``ndd.float32``) counts as one only when its name resolves statically to DALI.


def _constant_kwargs(**kwargs: Any) -> set[str] | None:
    return _source_analysis.constant_kwargs(sys._getframe(1), kwargs)


def _through_lazy() -> set[str] | None:
    return _constant_kwargs(dtype=lazy.float32, other=lazy.int64, layout="HWC")


def _through_real() -> set[str] | None:
    return _constant_kwargs(dtype=real.float32, other=real.int64, layout="HWC")


def test_the_capture_reads_ndd_as_a_direct_import() -> None:
    assert _through_real() == {"dtype", "other", "layout"}
    assert _through_lazy() == _through_real()
