"""The built-in sample dataset and image pipeline of ``python -m loader`` (public). Runs in both.

``ensure_sample_dataset`` writes a small ImageFolder of JPEGs (random shapes and colours) into a
cache directory once; ``image_source``/``image_step`` are the worker-side functions of the main
job's pipeline (decode, random resized crop 224, flip, normalize), shared with the benchmarks.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from workers import Shard, list_files

from ._ndd import ndd

DEFAULT_COUNT = 512
DEFAULT_CLASSES = 8


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dali-capture-loader" / f"sample-{DEFAULT_COUNT}"


def write_sample_dataset(
    root: str | os.PathLike[str],
    count: int = DEFAULT_COUNT,
    classes: int = DEFAULT_CLASSES,
    seed: int = 0,
) -> Path:
    """Write ``count`` JPEGs into ``root/class_XX/`` (ImageFolder layout). Returns ``root``."""
    from PIL import Image

    root = Path(root)
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    for index in range(count):
        label = index % classes
        folder = root / f"class_{label:02d}"
        folder.mkdir(exist_ok=True)
        height, width = (int(v) for v in rng.integers(160, 320, size=2))
        y = np.linspace(0, 1, height)[:, None, None]
        x = np.linspace(0, 1, width)[None, :, None]
        colour = rng.uniform(0, 255, size=(1, 1, 3))
        noise = rng.normal(0, 12, size=(height, width, 3))
        pixels = np.clip(colour * (0.4 + 0.6 * x * y) + noise, 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(folder / f"img_{index:05d}.jpg", quality=85)
    return root


def sample_dataset_ready(cache_dir: Path | None = None) -> bool:
    return ((cache_dir or default_cache_dir()) / ".complete").exists()


def ensure_sample_dataset(cache_dir: Path | None = None) -> Path:
    """The sample dataset's root, generating it on first use (atomically, safe in parallel)."""
    root = cache_dir or default_cache_dir()
    marker = root / ".complete"
    if marker.exists():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=root.parent))
    write_sample_dataset(staging)
    (staging / ".complete").write_text("ok\n")
    try:
        staging.rename(root)
    except OSError:
        # Another process finished first; keep its copy.
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
        if not marker.exists():
            raise
    return root


def list_images(root: str | os.PathLike[str]) -> tuple[list[str], list[int]]:
    """Files and class labels of an ImageFolder (``root/<class>/<image>``), sorted."""
    return list_files(root)


def image_source(
    shard: Shard, root: str, batch_size: int | None = None, shuffle: bool = True
) -> Any:
    """A File reader over this shard of an ImageFolder. ``batch_size``: the reader's
    ``max_batch_size``; None (the main job's): the Loader's, which the worker gives a reader
    built without one."""
    files, labels = list_images(root)
    if len(files) < shard.count:
        raise ValueError(
            f"{len(files)} images cannot be split into {shard.count} shards; "
            "use fewer workers or ranks, or more data"
        )
    return ndd.readers.File(
        files=files,
        labels=labels,
        shard_id=shard.index,
        num_shards=shard.count,
        random_shuffle=shuffle,
        seed=shard.seed,
        pad_last_batch=True,
        stick_to_shard=True,
        max_batch_size=batch_size,  # (None: the worker gives it the Loader's)
    )


def image_step(jpegs: Any, labels: Any) -> dict[str, Any]:
    """Decode, random resized crop to 224, random flip, normalize to float32 CHW."""
    images = ndd.decoders.image(jpegs, device="cpu")
    images = ndd.random_resized_crop(images, size=[224, 224])
    flip = ndd.random.coin_flip(probability=0.5, batch_size=images.batch_size)  # per sample
    images = ndd.crop_mirror_normalize(
        images,
        dtype=ndd.float32,
        mirror=flip,
        mean=[0.485 * 255, 0.456 * 255, 0.406 * 255],
        std=[0.229 * 255, 0.224 * 255, 0.225 * 255],
    )
    return {"image": images, "label": labels}
