"""A worker imports DALI without importing torch on the way, and torch still works after."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

import pytest

from workers.process._imports import torch_deferred

SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np
    from workers.process._imports import import_dali_modules

    import_dali_modules()
    assert "nvidia.dali.experimental.dynamic" in sys.modules
    assert "torch" not in sys.modules, "torch was imported with DALI"
    assert not [f for f in sys.meta_path if "TorchDeferred" in type(f).__name__], "hook left"

    import torch  # a source or step that uses torch gets it as usual
    import nvidia.dali.experimental.dynamic as ndd

    tensor = ndd.as_tensor(np.arange(6, dtype=np.int32).reshape(2, 3)).torch(copy=True)
    assert isinstance(tensor, torch.Tensor) and tensor.sum().item() == 15
    print("ok")
    """
)


def test_dali_is_imported_without_torch_and_torch_works_after() -> None:
    pytest.importorskip("torch")
    if importlib.util.find_spec("torchdata") is not None:
        pytest.skip("torchdata is installed: DALI imports its torchdata nodes, which need torch")
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_the_hook_is_removed_when_the_import_fails() -> None:
    finders = list(sys.meta_path)
    with pytest.raises(ZeroDivisionError), torch_deferred():
        raise ZeroDivisionError
    assert sys.meta_path == finders


def test_the_switch_turns_the_deferral_off(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    if importlib.util.find_spec("torchdata") is not None:
        pytest.skip("torchdata is installed: the deferral is off anyway")
    finders = list(sys.meta_path)
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.setenv("DALI_LOADER_DEFER_TORCH", "0")
    with torch_deferred():
        assert sys.meta_path == finders
    monkeypatch.setenv("DALI_LOADER_DEFER_TORCH", "1")
    with torch_deferred():
        assert len(sys.meta_path) == len(finders) + 1
    assert sys.meta_path == finders


def test_the_deferral_is_gated_on_the_dali_it_was_verified_with() -> None:
    import nvidia.dali

    from workers.process._imports import VERIFIED_DALI, dali_verified

    assert dali_verified() == nvidia.dali.__version__.startswith(VERIFIED_DALI)


PLAN = textwrap.dedent(
    """
    import sys
    import numpy as np
    from ipc.wire import Sampling
    from workers.process._imports import import_numpy_on_first_use
    from workers.sources.plan import shard_batches

    if sys.argv[1] == "server":
        import_numpy_on_first_use()
    before = set(sys.modules)
    shard_batches(Sampling(1000, 32, 0, True, False), 0, 0, 2, None)  # a shuffled epoch's plan
    np.unique(np.arange(5))  # (a tar shards' plan takes its parts' edges so)
    print(" ".join(sorted(n for n in set(sys.modules) - before if n.split(".")[0] == "numpy")))
    """
)


def test_a_plan_imports_no_numpy_module_after_the_server_imported_them() -> None:
    """A worker's first plan imports numpy's random and masked-array modules, numpy's own
    first-use imports; the worker server imports them as it warms, so its forks do not."""

    def imported(process: str) -> set[str]:
        done = subprocess.run(
            [sys.executable, "-c", PLAN, process], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        return set(done.stdout.split())

    assert {"numpy.random", "numpy.ma"} <= imported("worker")
    assert imported("server") == set()


def test_the_servers_imports_hold_what_a_first_dali_operator_imports() -> None:
    """A worker's first traced operator call imports DALI's debug-mode module; the server's
    warm-up imports it (torch still deferred), so its forks do not."""
    script = textwrap.dedent(
        """
        import sys
        from workers.process._imports import (
            DALI_ON_FIRST_USE, import_dali_modules, import_dali_on_first_use,
        )
        import_dali_modules()
        if sys.argv[1] == "server":
            import_dali_on_first_use()
        from nvidia.dali.experimental import dynamic as ndd
        before = set(sys.modules)
        ndd.cast(ndd.batch([[1], [2]]), dtype=ndd.int64)
        print(" ".join(sorted(set(DALI_ON_FIRST_USE) & (set(sys.modules) - before))))
        print("torch" in sys.modules)
        """
    )

    def imported(process: str) -> tuple[set[str], str]:
        done = subprocess.run(
            [sys.executable, "-c", script, process], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        first, torch = done.stdout.splitlines()
        return set(first.split()), torch

    assert imported("worker")[0] == {"nvidia.dali._debug_mode"}
    assert imported("server") == (set(), "False")
