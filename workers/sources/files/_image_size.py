"""A limit on the decoded size of an image, checked from its encoded header before DALI decodes
it. Runs in the worker.

A small file can decode to a huge image: a 560 KB PNG of 24000x24000 zeros takes DALI's decoder
to a peak of 3-4 GB, enough for the kernel's out-of-memory killer to end a worker under a memory
limit, and every replacement after it. The sources that hand DALI encoded bytes
(``sharded_files``, ``sharded_tars``) read the image's width and height from its header first
(a few bytes, no decoding: :func:`image_size`) and raise :class:`ImageTooLargeError` for one over
``max_image_pixels``; ``on_error="skip"`` then leaves that sample out like any sample whose
``load`` raises, and ``on_error="raise"`` stops the job naming it.

The formats are those DALI's ``decoders.image`` reads, known by their magic bytes (whatever the
file's extension): JPEG, PNG, WebP, BMP, TIFF, JPEG 2000, PNM. Anything else, or a header that
cannot be read (a truncated or corrupt file), is left to the decoder, which names what is wrong.

(DALI's decoders refuse some sizes themselves, after the bytes reach them: nvImageCodec's
libjpeg-turbo decoder says ``Image too large`` for a 60000x60000 JPEG and its OpenCV fallback
asserts ``pixels <= CV_IO_MAX_IMAGE_PIXELS``, 2**30; a 24000x24000 PNG, 576 M pixels, is
decoded.)
"""

from __future__ import annotations

import re
import struct
from typing import Any, NamedTuple

from ipc.wire import UNDECODABLE

#: The default limit: Pillow's decompression-bomb threshold (``PIL.Image.MAX_IMAGE_PIXELS``):
#: the pixels that take a quarter of a GiB decoded as 24-bit RGB (about 9460 x 9460).
MAX_IMAGE_PIXELS = 89_478_485

_PNG = b"\x89PNG\r\n\x1a\n"
_JP2 = b"\x00\x00\x00\x0cjP  \r\n\x87\n"
_J2K = b"\xff\x4f\xff\x51"
#: JPEG start-of-frame markers (baseline, progressive, lossless, arithmetic...): not DHT (C4),
#: JPG (C8) or DAC (CC)
_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
#: JPEG markers without a length: TEM, RST0-7 (SOI is read before the walk)
_STANDALONE = frozenset({0x01, *range(0xD0, 0xD8)})
#: The sizes of a BMP's info header, after BITMAPCOREHEADER's 12 (BITMAPINFOHEADER's 40, its
#: extensions, OS/2's 16 to 64, BITMAPV4HEADER's 108, BITMAPV5HEADER's 124)
_BMP_HEADERS = frozenset({16, 40, 52, 56, 64, 108, 124})
#: A PNM header: magic, then width and height, with whitespace and comments between
_PNM = re.compile(rb"P[1-6](?:\s|#[^\r\n]*[\r\n])+(\d+)(?:\s|#[^\r\n]*[\r\n])+(\d+)")


class ImageSize(NamedTuple):
    """An encoded image's format and its decoded width and height, from its header."""

    format: str
    width: int
    height: int

    @property
    def pixels(self) -> int:
        return self.width * self.height


class ImageTooLargeError(ValueError):
    """A sample's image would decode to more pixels than ``max_image_pixels``: it was not
    decoded (``on_error="skip"`` leaves it out; the message names it and the limit)."""

    #: the kind of skip the skip-limit error counts it as (``ipc.wire.UNDECODABLE``)
    skip_kind = UNDECODABLE

    @classmethod
    def of(cls, name: str, size: ImageSize, limit: int, source: str) -> ImageTooLargeError:
        """The error for image ``name`` of ``size``, over ``limit``; ``source``: where the limit
        is set (``"sharded_files or FilesDataset"``)."""
        gib = size.pixels * 3 / 2**30
        return cls(
            f"{name}: a {size.width}x{size.height} {size.format} image, {size.pixels:,} pixels, "
            f"over max_image_pixels={limit:,} (decoded as RGB it takes {gib:,.1f} GiB); it was "
            f"not decoded. To read such images pass max_image_pixels= a larger number (or None: "
            f'no limit) to {source}; on_error="skip" leaves them out'
        )


def checked_limit(limit: int | None) -> int | None:
    """``max_image_pixels`` as given, checked: None (no limit) or a positive integer."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(
            f"max_image_pixels must be None (no limit) or a positive number of pixels, got "
            f"{limit!r}"
        )
    return limit


def over_limit(data: Any, limit: int | None) -> ImageSize | None:
    """The size of the image ``data`` (encoded bytes: a uint8 array, bytes) holds when it is
    over ``limit`` pixels; None when it is not, has no limit, or is not an image read here."""
    if limit is None:
        return None
    size = image_size(data)
    return size if size is not None and size.pixels > limit else None


def image_size(data: Any) -> ImageSize | None:
    """The format, width and height of the encoded image ``data`` (anything with the buffer
    protocol), read from its header; None when it is not in a format read here, or its header
    cannot be read."""
    try:
        view = memoryview(data).cast("B")
    except (TypeError, ValueError):  # not one contiguous run of bytes: not encoded bytes
        return None
    head = bytes(view[:16])
    try:
        if head.startswith(b"\xff\xd8\xff"):
            return _jpeg(view)
        if head.startswith(_PNG):
            return _png(view)
        if head.startswith(b"RIFF") and head[8:12] == b"WEBP":
            return _webp(view)
        if head.startswith((b"II*\x00", b"MM\x00*")):
            return _tiff(view)
        if head.startswith(b"BM"):
            return _bmp(view)
        if head.startswith(_JP2):
            return _jp2(view)
        if head.startswith(_J2K):
            return _j2k(view, 0)
        if len(head) > 2 and head[0] == ord("P") and head[1] in b"123456":
            return _pnm(bytes(view[:4096]))
    except (struct.error, ValueError, IndexError):
        return None  # a header cut short: the decoder says what is wrong
    return None


def _sized(kind: str, width: int, height: int) -> ImageSize | None:
    return ImageSize(kind, width, height) if width > 0 and height > 0 else None


def _png(view: memoryview) -> ImageSize | None:
    if bytes(view[12:16]) != b"IHDR":
        return None
    width, height = struct.unpack_from(">II", view, 16)
    return _sized("PNG", width, height)


def _jpeg(view: memoryview) -> ImageSize | None:
    """Walks the markers up to the first start of frame (its height and width)."""
    at, end = 2, len(view)
    while at + 4 <= end:
        if view[at] != 0xFF:
            return None
        marker = view[at + 1]
        if marker == 0xFF:  # a fill byte
            at += 1
        elif marker in _STANDALONE:
            at += 2
        elif marker in (0xD8, 0xD9, 0xDA):  # SOI again, EOI or scan data before a frame
            return None
        else:
            if marker in _SOF:
                height, width = struct.unpack_from(">HH", view, at + 5)
                return _sized("JPEG", width, height)
            (length,) = struct.unpack_from(">H", view, at + 2)
            if length < 2:
                return None
            at += 2 + length
    return None


def _webp(view: memoryview) -> ImageSize | None:
    chunk = bytes(view[12:16])
    if chunk == b"VP8 ":  # lossy: 14-bit width and height after the frame's start code
        if bytes(view[23:26]) != b"\x9d\x01\x2a":
            return None
        width, height = struct.unpack_from("<HH", view, 26)
        return _sized("WebP", width & 0x3FFF, height & 0x3FFF)
    if chunk == b"VP8L":  # lossless: 14 bits each, minus one, after the signature byte
        (bits,) = struct.unpack_from("<I", view, 21)
        return _sized("WebP", (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1)
    if chunk == b"VP8X":  # extended: the canvas, 24 bits each, minus one
        width = int.from_bytes(view[24:27], "little") + 1
        height = int.from_bytes(view[27:30], "little") + 1
        return _sized("WebP", width, height)
    return None


def _tiff(view: memoryview) -> ImageSize | None:
    """The first image's ImageWidth (256) and ImageLength (257) tags (what DALI decodes)."""
    order = "<" if view[0] == ord("I") else ">"
    (first,) = struct.unpack_from(order + "I", view, 4)
    (count,) = struct.unpack_from(order + "H", view, first)
    found: dict[int, int] = {}
    for entry in range(first + 2, first + 2 + 12 * count, 12):
        tag, kind = struct.unpack_from(order + "HH", view, entry)
        if tag in (256, 257) and kind in (3, 4):  # SHORT or LONG
            (found[tag],) = struct.unpack_from(order + ("H" if kind == 3 else "I"), view, entry + 8)
            if len(found) == 2:
                return _sized("TIFF", found[256], found[257])
    return None


def _bmp(view: memoryview) -> ImageSize | None:
    """A bitmap's info header, when its size is one of the known ones and it has one plane
    (text that starts with ``BM``, a caption in a tar, is not a bitmap)."""
    (header,) = struct.unpack_from("<I", view, 14)
    if header == 12:  # OS/2's BITMAPCOREHEADER: unsigned 16-bit sizes
        width, height, planes = struct.unpack_from("<HHH", view, 18)
    elif header in _BMP_HEADERS:  # a negative height is a top-down bitmap
        width, height, planes = struct.unpack_from("<iiH", view, 18)
    else:
        return None
    return _sized("BMP", width, abs(height)) if planes == 1 else None


def _jp2(view: memoryview) -> ImageSize | None:
    """The ``ihdr`` box in the ``jp2h`` header box (or the codestream's SIZ, if that comes
    first)."""
    at, end = 0, len(view)
    while at + 8 <= end:
        length, kind = struct.unpack_from(">I4s", view, at)
        header = 8
        if length == 1:
            (length,) = struct.unpack_from(">Q", view, at + 8)
            header = 16
        elif length == 0:
            length = end - at
        if length < header:
            return None
        if kind == b"jp2h":  # a super box: ihdr comes first in it
            at += header
            continue
        if kind == b"ihdr":
            height, width = struct.unpack_from(">II", view, at + header)
            return _sized("JPEG 2000", width, height)
        if kind == b"jp2c":
            return _j2k(view, at + header)
        at += length
    return None


def _j2k(view: memoryview, at: int) -> ImageSize | None:
    """A JPEG 2000 codestream's SIZ segment: the reference grid less the image's offset."""
    if bytes(view[at : at + 4]) != _J2K:
        return None
    grid_width, grid_height, left, top = struct.unpack_from(">IIII", view, at + 8)
    return _sized("JPEG 2000", grid_width - left, grid_height - top)


def _pnm(head: bytes) -> ImageSize | None:
    found = _PNM.match(head)
    if found is None:
        return None
    return _sized("PNM", int(found.group(1)), int(found.group(2)))
