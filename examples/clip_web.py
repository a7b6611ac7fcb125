"""A CLIP-style loop over image-text shards as img2dataset writes them (``00000.tar`` ... with
``.jpg`` + ``.txt`` + ``.json`` per sample, a ``.parquet`` and ``_stats.json`` beside each tar).

    python examples/clip_web.py /data/laion-shards --steps 100 --state clip-state.pt

* The images are decoded and resized inside ``step`` (DALI, in the workers); the captions come
  through as bytes and are tokenized in the trainer, after ``next()``: ``step`` is traced once
  and replayed, so Python written there runs when the loop is captured, not for every batch
  (the Python that runs every batch is the trainer's, here).
* ``optional={"txt": b""}``: a sample without a caption gets ``""`` (counted in
  ``stats().defaulted``) instead of being skipped; a truncated JPEG is skipped, named
  ``<tar>:<key>`` in the log.
* A batch never holds a sample twice: the row a skipped sample leaves is cut (the default,
  ``cut_replaced=True``; ``batch.info.cut_rows`` says which), and ``cut_padding=True`` cuts the
  epoch's padding too, so a contrastive loss needs no mask. With ``cut_replaced=False`` (a fixed
  batch shape), mask the rows ``batch.info.replaced``; without ``cut_padding``, the last
  ``batch.info.padded``.
* The loader's state is saved half-way and a second loader with another worker count resumes
  from it: every pair of the epoch comes once.

The "model" is a stand-in (a hash tokenizer, no training): the script shows the data side.
"""

from __future__ import annotations

import argparse
import zlib
from typing import Any

import numpy as np
import torch

import loader
from loader import Loader, TarsDataset, ndd

#: tokens per caption
CONTEXT = 32


def clip_step(jpg: Any, txt: Any, key: Any) -> dict[str, Any]:
    """In the workers: decode and resize the images; the captions and keys pass through."""
    images = ndd.decoders.image(jpg, device="cpu")
    return {"image": ndd.resize(images, size=(64, 64)), "txt": txt, "key": key}


def tokenize(captions: list[str]) -> torch.Tensor:
    """A stand-in tokenizer (words hashed to ids), shaped as CLIP's: (batch, CONTEXT) int32."""
    tokens = np.zeros((len(captions), CONTEXT), dtype=np.int32)
    for row, caption in enumerate(captions):
        ids = [zlib.crc32(word.encode()) % 49_000 + 1 for word in caption.split()][:CONTEXT]
        tokens[row, : len(ids)] = ids
    return torch.from_numpy(tokens)


def make_loader(shards: str, workers: int) -> Loader:
    dataset = TarsDataset(shards, ext=("jpg", "txt", "__key__"), optional={"txt": b""})
    return Loader(
        dataset,
        clip_step,
        batch_size=16,
        num_workers=workers,
        output="torch",
        on_error="skip",
        cut_padding=True,
    )


def train(data: Loader, steps: int) -> list[str]:
    """``steps`` batches of the loop; returns the keys seen."""
    seen: list[str] = []
    for _step, batch in zip(range(steps), data, strict=False):
        captions = loader.texts(batch["txt"])  # list[str], one per row
        tokens = tokenize(captions)
        images = batch["image"].permute(0, 3, 1, 2).float() / 255
        keys = loader.texts(batch["key"])
        assert len(set(keys)) == len(keys) == len(images) == len(tokens)
        seen += keys
        print(f"step {batch.info.step}: images {tuple(images.shape)}, tokens {tuple(tokens.shape)}")
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("shards", help="a directory of img2dataset shards, a glob or a pattern")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--state", default="clip-state.pt")
    args = parser.parse_args()
    with make_loader(args.shards, workers=2) as data:
        first = train(data, args.steps // 2)
        torch.save(data.state_dict(), args.state)
    with make_loader(args.shards, workers=3) as data:  # another layout: exactly once all the same
        data.load_state_dict(torch.load(args.state, weights_only=False))
        rest = train(data, len(data))
        stats = data.stats()
    assert not set(first) & set(rest)
    print(
        f"resumed: {len(first)} + {len(rest)} pairs, none twice; captions defaulted: "
        f"{dict(stats.defaulted)}; skipped: {[name for _id, name in stats.skipped]}"
    )


if __name__ == "__main__":
    main()
