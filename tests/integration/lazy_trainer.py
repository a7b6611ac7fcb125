"""A trainer run as its own process: a job over ``tests.lazy_pipelines`` (DALI named only through
``from loader import ndd``) or the twin that ``STEP_MODULE`` names. Two epochs with
``output="torch"``, a third stopped half-way and its state saved; a new loader resumes it and
runs one more epoch; on the way it asks for stats, a diagnosis and the state. Prints one JSON
line: the sample ids per epoch, a hash of the images' bytes, the traces per worker, the
warnings, the DALI modules the process holds, its resident memory, and the seconds from the
process's start until its imports were done.

    python -m tests.integration.lazy_trainer IMAGE_ROOT [STEP_MODULE]
"""

from __future__ import annotations

import hashlib
import importlib
import itertools
import json
import sys
import time
import warnings

import psutil

from loader import Loader

DIGEST = hashlib.sha256()


def _ids(batch: object) -> list[int]:
    """The batch's sample ids; its images go into :data:`DIGEST`."""
    import numpy as np

    DIGEST.update(np.ascontiguousarray(np.asarray(batch["image"])).tobytes())  # type: ignore[index]
    return [int(v) for v in np.asarray(batch["id"]).ravel()]  # type: ignore[index]


def main(caught: list[warnings.WarningMessage]) -> None:
    import functools

    from loader.sample import list_images

    root = sys.argv[1]
    steps = importlib.import_module(sys.argv[2] if len(sys.argv) > 2 else "tests.lazy_pipelines")
    imported = time.time() - psutil.Process().create_time()
    files, _ = list_images(root)
    source = functools.partial(steps.files_source, files=tuple(files))
    epochs: list[list[int]] = []
    kwargs = {"batch_size": 4, "num_workers": 2, "copy": True, "seed": 5}
    with Loader(source, steps.augment_step, output="torch", **kwargs) as loader:
        for _ in range(2):
            epochs.append([i for b in loader for i in _ids(b)])
        batches = iter(loader)
        epochs.append([i for b in itertools.islice(batches, len(loader) // 2) for i in _ids(b)])
        state = json.loads(json.dumps(loader.state_dict()))
        traces = [w.traces for w in loader.stats().workers]
        loader.diagnose(window=5.0)
    with Loader(source, steps.augment_step, **kwargs) as resumed:
        resumed.load_state_dict(state)
        epochs[-1] += [i for b in resumed for i in _ids(b)]
        epochs.append([i for b in resumed for i in _ids(b)])
        resumed.state_dict()
        traces += [w.traces for w in resumed.stats().workers]
    print(
        json.dumps(
            {
                "epochs": epochs,
                "files": len(files),
                "digest": DIGEST.hexdigest(),
                "traces": traces,
                "warnings": [str(w.message) for w in caught],
                "dali_modules": sorted(m for m in sys.modules if m.startswith("nvidia.dali")),
                "rss": psutil.Process().memory_info().rss,
                "import_seconds": imported,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        main(caught)
