"""Image sizes read from encoded headers (``workers.sources.files._image_size``), against Pillow's
reading of the same files, and the ``max_image_pixels`` limit of ``sharded_files``' loads."""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from loader import FilesDataset, ImageTooLargeError, Shard
from workers.sources.files._files import FileLoader, ListedFiles
from workers.sources.files._image_size import MAX_IMAGE_PIXELS, ImageSize, image_size, over_limit

WIDTH, HEIGHT = 53, 37

#: (Pillow's format, save options, mode, the format named)
FORMATS = [
    ("JPEG", {}, "RGB", "JPEG"),
    ("JPEG", {"progressive": True}, "L", "JPEG"),
    ("JPEG", {"exif": b"Exif\0\0" + bytes(5000)}, "RGB", "JPEG"),  # a segment before the frame
    ("PNG", {}, "RGBA", "PNG"),
    ("PNG", {}, "1", "PNG"),
    ("WEBP", {}, "RGB", "WebP"),
    ("WEBP", {"lossless": True}, "RGB", "WebP"),
    ("WEBP", {"save_all": True, "duration": 10}, "RGB", "WebP"),  # animated: VP8X
    ("BMP", {}, "RGB", "BMP"),
    ("TIFF", {}, "RGB", "TIFF"),
    ("TIFF", {"compression": "tiff_lzw"}, "L", "TIFF"),
    ("JPEG2000", {}, "RGB", "JPEG 2000"),
    ("JPEG2000", {"no_jp2": True}, "RGB", "JPEG 2000"),  # a bare codestream
    ("PPM", {}, "RGB", "PNM"),
    ("PPM", {}, "1", "PNM"),
]


def encoded(kind: str, options: dict[str, Any], mode: str) -> bytes:
    pixels = np.random.default_rng(0).integers(0, 256, (HEIGHT, WIDTH, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(out, kind, **options)
    return out.getvalue()


@pytest.mark.parametrize(("kind", "options", "mode", "named"), FORMATS)
def test_the_header_gives_the_size_pillow_reads(
    kind: str, options: dict[str, Any], mode: str, named: str
) -> None:
    data = encoded(kind, options, mode)
    assert Image.open(io.BytesIO(data)).size == (WIDTH, HEIGHT)
    assert image_size(np.frombuffer(data, dtype=np.uint8)) == ImageSize(named, WIDTH, HEIGHT)


def test_a_bomb_is_sized_from_its_header_alone() -> None:
    ihdr = struct.pack(">IIBBBBB", 24000, 24000, 8, 0, 0, 0, 0)
    crc = struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    header = b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + ihdr + crc
    assert over_limit(header, MAX_IMAGE_PIXELS) == ImageSize("PNG", 24000, 24000)
    assert over_limit(header, None) is None
    jpeg = bytearray(encoded("JPEG", {}, "RGB"))
    frame = jpeg.index(b"\xff\xc0")
    struct.pack_into(">HH", jpeg, frame + 5, 60000, 60000)
    assert image_size(bytes(jpeg)) == ImageSize("JPEG", 60000, 60000)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"hello",
        b"P3 is not an image",
        b"BMX riders on a dirt track at dusk, seen from the side",  # a caption, not a bitmap
        b"\x89PNG\r\n\x1a\n",
        b"\xff\xd8\xff\xe0\x00",
    ],
    ids=["empty", "text", "text-like-pnm", "text-like-bmp", "png-cut-short", "jpeg-cut-short"],
)
def test_what_is_not_a_readable_image_header_is_left_to_the_decoder(data: bytes) -> None:
    assert image_size(data) is None
    assert over_limit(data, 1) is None


def test_the_default_limit_is_pillows() -> None:
    assert Image.MAX_IMAGE_PIXELS == MAX_IMAGE_PIXELS


def test_a_file_over_the_limit_raises_naming_it_and_the_limit(tmp_path: Path) -> None:
    path = tmp_path / "wide.jpg"
    path.write_bytes(encoded("JPEG", {}, "RGB"))
    files = ListedFiles([str(path)], [7])
    data, label = FileLoader(files, WIDTH * HEIGHT)(0)  # at the limit: read
    assert data.tobytes() == path.read_bytes() and int(label[0]) == 7
    assert FileLoader(files, None)(0)[0].size == path.stat().st_size
    with pytest.raises(ImageTooLargeError, match="max_image_pixels=1,960") as info:
        FileLoader(files, WIDTH * HEIGHT - 1)(0)
    assert str(info.value).startswith(f"{path}: a 53x37 JPEG image, 1,961 pixels")
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("limit", [0, -5, True, 1.5, "89M"])
def test_max_image_pixels_must_be_a_positive_integer_or_none(limit: Any, tmp_path: Path) -> None:
    shard = Shard.make(rank=0, world_size=1, worker=0, num_workers=1, seed=0)
    dataset = FilesDataset([str(tmp_path / "a.jpg")], max_image_pixels=limit)
    with pytest.raises(ValueError, match=r"max_image_pixels must be None .* got"):
        dataset.open(shard, 0)
