"""Image bombs: a small file whose header says it decodes to a huge image is never handed to
DALI. Its ``load`` raises ``ImageTooLargeError`` (the limit read from the header: no decoding),
so ``on_error="skip"`` skips it like any failing sample and ``on_error="raise"`` names it; the
worker's memory stays that of small images. Real workers, real DALI, one worker each."""

from __future__ import annotations

import functools
import io
import logging
import struct
import tarfile
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loader import ImageTooLargeError, Loader, Shard, list_images, sharded_tars
from loader.sample import write_sample_dataset
from tests import pipelines as P

pytestmark = pytest.mark.timeout(120)

#: The bomb's width and height: 576 M pixels, over the default limit (Pillow's, ~89 M)
SIDE = 24000
#: A worker's peak resident memory must stay under this (decoding the bomb: ~2-4 GB)
PEAK_LIMIT = 1 << 30
BATCH = 4
GOOD = 7  # good images, with the bomb: 2 batches of 4


def write_png_bomb(path: Path, side: int = SIDE) -> None:
    """A 1-bit greyscale PNG of ``side`` x ``side`` zeros: about 70 KB on disk, ``side**2``
    pixels (1.7 GB as RGB) decoded."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data)
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    row = bytes(1 + (side + 7) // 8)  # the filter byte, then the row's bits
    packer = zlib.compressobj(9)
    idat = [packer.compress(row * min(1000, side - top)) for top in range(0, side, 1000)]
    idat.append(packer.flush())
    header = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)  # 1 bit, greyscale
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", b"".join(idat))
        + chunk(b"IEND", b"")
    )


@pytest.fixture(scope="module")
def bomb_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """An ImageFolder of small JPEGs and the bomb (``class_00/bomb.png``)."""
    root = write_sample_dataset(tmp_path_factory.mktemp("bombs"), count=GOOD, classes=2, seed=3)
    bomb = root / "class_00" / "bomb.png"
    write_png_bomb(bomb)
    return root, str(bomb)


@pytest.fixture(scope="module")
def bomb_tar(bomb_folder: tuple[Path, str], tmp_path_factory: pytest.TempPathFactory) -> str:
    """One tar shard of the same images: sample ``s<i>`` is ``.jpg`` (or ``.png``, the bomb)
    and ``.id`` (``i``), the bomb third."""
    root, bomb = bomb_folder
    files, _labels = list_images(root)
    files.remove(bomb)
    files.insert(2, bomb)
    path = tmp_path_factory.mktemp("bomb-tars") / "train-000.tar"
    with tarfile.open(path, "w") as tar:
        for index, file in enumerate(files):
            ext = Path(file).suffix
            for name, data in ((ext, Path(file).read_bytes()), (".id", str(index).encode())):
                info = tarfile.TarInfo(f"s{index:03d}{name}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return str(path)


def tar_source(shard: Shard, url: str) -> Any:
    """The tar's images (whichever of .jpg and .png a sample has) and ids."""
    return sharded_tars(shard, url, batch_size=BATCH, ext=("jpg;png", "id"))


def peak_memory(pid: int) -> int:
    """A live process's peak resident memory, in bytes (``VmHWM``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for process {pid}")


def epoch_under_skip(loader: Loader, key: str) -> tuple[list[int], list[str]]:
    """One epoch's real sample ids (no padding, no replaced rows) and skipped names; asserts
    the worker's peak memory before it ends."""
    ids: list[int] = []
    skipped: list[str] = []
    for batch in loader:
        # full batches but for a skipped sample's row, cut off (cut_replaced=True)
        assert np.asarray(batch["image"]).shape == (BATCH - batch.info.cut, 8, 8, 3)
        assert batch.info.cut == len(batch.info.skipped_names)
        values = [int(v) for v in np.asarray(batch[key]).ravel()]
        keep = len(values) - batch.info.padded
        ids += [v for row, v in enumerate(values[:keep]) if row not in batch.info.replaced]
        skipped += batch.info.skipped_names
    [pid] = loader.worker_pids()
    peak = peak_memory(pid)
    assert peak < PEAK_LIMIT, f"the worker's peak memory was {peak / 2**20:,.0f} MiB"
    return ids, skipped


def test_a_png_bomb_in_an_image_folder_is_skipped_undecoded(
    bomb_folder: tuple[Path, str], caplog: pytest.LogCaptureFixture
) -> None:
    root, bomb = bomb_folder
    files, _labels = list_images(root)
    caplog.set_level(logging.WARNING, logger="loader")
    source = functools.partial(P.files_with_ids_source, root=str(root), batch_size=BATCH)
    with Loader(
        source, P.decode_files_step, batch_size=BATCH, num_workers=1, on_error="skip", copy=True
    ) as loader:
        ids, skipped = epoch_under_skip(loader, "label")
        stats = loader.stats()
    assert sorted(ids) == [i for i, file in enumerate(files) if file != bomb]  # each once
    assert skipped == [bomb]
    assert list(stats.skipped) == [(files.index(bomb), bomb)]
    [warned] = [r.message for r in caplog.records if "skipped sample" in r.message]
    assert bomb in warned and "ImageTooLargeError" in warned and "max_image_pixels" in warned


def raised_within_30_s(source: Any, step: Any) -> str:
    """The text of the ``ImageTooLargeError`` an epoch of ``source`` raises, within 30 s."""
    started = time.monotonic()
    with pytest.raises(ImageTooLargeError) as info:
        with Loader(source, step, batch_size=BATCH, num_workers=1) as loader:
            list(loader)
    assert time.monotonic() - started < 30
    return str(info.value)


def test_a_png_bomb_in_an_image_folder_raises_naming_it(bomb_folder: tuple[Path, str]) -> None:
    root, bomb = bomb_folder
    source = functools.partial(P.files_with_ids_source, root=str(root), batch_size=BATCH)
    message = raised_within_30_s(source, P.decode_files_step)
    assert message.startswith(f"{bomb}: a 24000x24000 PNG image, 576,000,000 pixels")
    assert "over max_image_pixels=89,478,485" in message
    assert "max_image_pixels= a larger number (or None: no limit) to sharded_files" in message
    assert "[worker 0, shard 0/1, epoch 0, step " in message


def test_a_png_bomb_in_a_tar_shard_is_skipped_undecoded(bomb_tar: str) -> None:
    source = functools.partial(tar_source, url=bomb_tar)
    with Loader(
        source, P.bytes_and_label_step, batch_size=BATCH, num_workers=1, on_error="skip"
    ) as loader:
        ids, skipped = epoch_under_skip(loader, "id")
        stats = loader.stats()
    assert sorted(ids) == [i for i in range(GOOD + 1) if i != 2]  # each once
    assert skipped == [f"{bomb_tar}:s002"]
    assert list(stats.skipped) == [(2, f"{bomb_tar}:s002")]


def test_a_png_bomb_in_a_tar_shard_raises_naming_it(bomb_tar: str) -> None:
    source = functools.partial(tar_source, url=bomb_tar)
    message = raised_within_30_s(source, P.bytes_and_label_step)
    assert message.startswith(f"{bomb_tar}:s002.png: a 24000x24000 PNG image")
    assert "over max_image_pixels=89,478,485" in message and "sharded_tars" in message
