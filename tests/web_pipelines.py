"""Image-text shards as img2dataset writes them, and the pipelines of their tests (workers import
them by module).

:func:`write_web_shards`: 7 shards ``00000.tar`` ... ``00006.tar`` of 220 samples in all (uneven),
each sample ``<key>.jpg`` + ``<key>.txt`` + ``<key>.json`` with a 9-digit key (shard * 10000 +
row, as img2dataset numbers them), a ``.parquet`` and a ``_stats.json`` beside every tar;
captions with non-ASCII text; :data:`NO_CAPTION` samples have no ``.txt`` and the
:data:`TRUNCATED` one a truncated ``.jpg``.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Any

import numpy as np

from loader import ndd

#: samples per shard (220 in all)
COUNTS = (40, 35, 30, 33, 28, 31, 23)
TOTAL = sum(COUNTS)
#: (shard, row) of the samples without a ``.txt``
NO_CAPTION = ((0, 5), (2, 11), (4, 3), (6, 20))
#: (shard, row) of the sample whose ``.jpg`` is cut short
TRUNCATED = (3, 7)
#: the side of every image
SIDE = 16


def key_of(shard: int, row: int) -> str:
    return f"{shard * 10000 + row:09d}"


def caption_of(shard: int, row: int) -> str:
    return f"Ünïcode café ☕ 写真 {shard}-{row}"


def _jpeg(seed: int) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (SIDE, SIDE, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=90)
    return out.getvalue()


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_web_shards(directory: Path) -> list[Path]:
    """The shards (see the module), with img2dataset's sidecar files; returns the tars."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for shard, count in enumerate(COUNTS):
        path = directory / f"{shard:05d}.tar"
        keys, captions = [], []
        with tarfile.open(path, "w") as tar:
            for row in range(count):
                key = key_of(shard, row)
                jpeg = _jpeg(shard * 10000 + row)
                if (shard, row) == TRUNCATED:
                    jpeg = jpeg[: len(jpeg) // 3]
                _add(tar, f"{key}.jpg", jpeg)
                caption = caption_of(shard, row)
                if (shard, row) not in NO_CAPTION:
                    _add(tar, f"{key}.txt", caption.encode())
                meta = {"key": key, "caption": caption, "url": f"https://example.com/{key}.jpg"}
                _add(tar, f"{key}.json", json.dumps(meta, ensure_ascii=False).encode())
                keys.append(key)
                captions.append(caption)
        table = pa.table({"key": keys, "caption": captions, "status": ["success"] * count})
        pq.write_table(table, directory / f"{shard:05d}.parquet")
        stats = {"count": count, "successes": count, "failed_to_download": 0}
        (directory / f"{shard:05d}_stats.json").write_text(json.dumps(stats))
        paths.append(path)
    return paths


def clip_step(jpg: Any, txt: Any, key: Any) -> dict[str, Any]:
    """Decode and resize the images; the captions and keys pass through as bytes."""
    images = ndd.decoders.image(jpg, device="cpu")
    return {"image": ndd.resize(images, size=(8, 8)), "txt": txt, "key": key}


def key_step(txt: Any, key: Any, url: Any) -> dict[str, Any]:
    """No decoding: the caption, the key and the url as they are."""
    return {"txt": txt, "key": key, "url": url}


def key_step_txt(txt: Any) -> dict[str, Any]:
    """The caption alone."""
    return {"txt": txt}


#: a trainer script over :func:`write_web_shards`'s shards (argv: the folder, ``on_error``): one
#: worker, the CLIP step; prints the rows it got
TRAINER_SCRIPT = """
import sys

from loader import Loader, TarsDataset
from tests import web_pipelines as W


def main():
    dataset = TarsDataset(sys.argv[1], ext=("jpg", "txt", "__key__"), optional={"txt": b""})
    with Loader(dataset, W.clip_step, batch_size=16, num_workers=1, on_error=sys.argv[2]) as run:
        rows = sum(len(batch["key"]) for batch in run)
    print("rows", rows)


if __name__ == "__main__":
    main()
"""
