"""Sources and steps that name DALI only through ``from loader import ndd`` (the lazy form), so a
trainer that imports them imports no DALI. The tests make a twin of this file whose only change
is the direct import, and compare the two; keep that import line as it is."""

from __future__ import annotations

from typing import Any

from loader import Shard, ndd, sharded_files
from loader.sample import list_images

#: The RNG the augment step makes on its first call (one per worker process).
_flip_rng: ndd.random.RNG | None = None


def id_reader(shard: Shard, root: str, batch_size: int = 4, shuffle: bool = True) -> Any:
    """A File reader whose label is the file's global index (a sample id), shuffled with the
    shard's seed."""
    files, _labels = list_images(root)
    return ndd.readers.File(
        files=files,
        labels=list(range(len(files))),
        shard_id=shard.index,
        num_shards=shard.count,
        random_shuffle=shuffle,
        seed=shard.seed,
        max_batch_size=batch_size,
        stick_to_shard=True,
        pad_last_batch=True,
    )


def files_source(shard: Shard, files: tuple[str, ...], batch_size: int = 4) -> Any:
    """sharded_files over a list of files, shuffled; the label of file k is k (a sample id)."""
    return sharded_files(
        shard, list(files), batch_size=batch_size, shuffle=True, labels=list(range(len(files)))
    )


def augment_step(jpegs: ndd.Batch, ids: ndd.Batch) -> dict[str, ndd.Batch]:
    """Decode, random resized crop (the default RNG), a coin-flip
    mirror from an RNG the step makes, normalize; the ids as int64. Checks its inputs' class."""
    global _flip_rng
    if not isinstance(jpegs, ndd.Batch):
        raise TypeError(f"the step got a {type(jpegs).__name__}, not an ndd.Batch")
    if _flip_rng is None:
        _flip_rng = ndd.random.RNG(seed=1234)
    images = ndd.decoders.image(jpegs, device="cpu")
    images = ndd.resize(images, size=[20, 20])
    images = ndd.random_resized_crop(images, size=[12, 12])
    flip = ndd.random.coin_flip(probability=0.5, batch_size=images.batch_size, rng=_flip_rng)
    images = ndd.crop_mirror_normalize(images, dtype=ndd.float32, mirror=flip)
    return {"image": images, "id": ndd.cast(ids, dtype=ndd.int64)}
