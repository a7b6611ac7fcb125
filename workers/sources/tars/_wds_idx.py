"""DALI's ``wds2idx`` index format: ``<name>.idx`` beside ``<name>.tar``. Runs in the worker.

The format DALI's ``wds2idx`` tool writes and its ``readers.webdataset`` reads
(``index_paths=``)::

    v1.2 <samples>
    <ext> <data offset> <size> <member name> [<ext> <data offset> <size> <member name>]...
    ...

one line per sample, in tar order, and on it each member of the sample in tar order: its
extension (the member name after the first dot of its file name), where its data starts (a
multiple of 512: after its header), its size and its name. :func:`format_idx` writes exactly
what ``wds2idx`` writes for the same tar; :func:`parse_idx` reads it back as a
:class:`~sources.tars._index.TarIndex`, checking what a scan checks. ``v1.1`` (members without
names) carries no keys, which the loader needs for names and fingerprints: such a file is not
used (a message says so; the shard is indexed instead). A member name with white space cannot be
written in this format: such a shard's index stays in the node's cache only.

An ``.idx`` says nothing of the tar it was made from, and may lie. :func:`parse_idx` refuses
entries that no tar can hold: members out of tar order, or whose data overlaps another's or leaves
no room for the member's own 512-byte header before it. :func:`fits` checks the tar's size (it
ends just after the last member, as a tar does) and :func:`header_mismatch` the header of the last
member (512 bytes before its data: its name and size), which a tar rewritten with other samples
or other member sizes does not keep. Every other member's header is checked by the tar loader as
it reads the member (:func:`member_mismatch`: the header lies just before the member's data, in
the bytes it reads anyway). The dataset summary (:mod:`sources.tars._summary`) records each tar's
size and ETag or mtime as well.
"""

from __future__ import annotations

import tarfile

import numpy as np

from ._index import IndexBuilder, TarIndex, split_name

VERSION = "v1.2"
_BLOCK = 512
#: Bytes a tar may hold after its last member's data: padding to a 512-byte block, the two
#: end-of-archive blocks, and a record's padding (tar pads to 20 blocks; allow a large factor).
_TAIL = 511 + 1024 + (1 << 20)


def idx_url(tar_url: str) -> str:
    """``<name>.idx`` beside ``<name>.tar`` (``train-000000.tar`` -> ``train-000000.idx``)."""
    return (tar_url[: -len(".tar")] if tar_url.endswith(".tar") else tar_url) + ".idx"


def format_idx(index: TarIndex) -> bytes | None:
    """The ``.idx`` text of ``index``; None when a member name holds white space (the format
    separates fields with it)."""
    lines = [f"{VERSION} {index.samples}\n"]
    exts = index.exts
    samples = index.member_sample.tolist()
    ext_ids = index.member_ext.tolist()
    offsets = index.member_offset.tolist()
    sizes = index.member_size.tolist()
    fields: list[str] = []
    current = 0
    keys = [index.key(sample) for sample in range(index.samples)]
    for sample, ext_id, offset, size in zip(samples, ext_ids, offsets, sizes, strict=True):
        if sample != current:
            lines.append(" ".join(fields) + "\n")
            fields, current = [], sample
        ext = exts[ext_id]
        name = f"{keys[sample]}.{ext}"
        if any(character.isspace() for character in name):
            return None
        fields += [ext, str(offset), str(size), name]
    lines.append(" ".join(fields) + "\n")
    return "".join(lines).encode("utf-8", "surrogateescape")


def _lines_of(where: str, data: bytes) -> list[str]:
    """The sample lines of a ``v1.2`` index (its head line checked and dropped)."""
    text = data.decode("utf-8", "surrogateescape")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    head = lines[0].split() if lines else []
    if len(head) < 2 or not head[1].isdigit():
        raise ValueError(f"{where} is not a wds2idx index (its first line is {lines[:1]!r})")
    version, count = head[0], int(head[1])
    if version != VERSION:
        raise ValueError(
            f"{where} is a {version} index; the loader reads {VERSION} (with member names: "
            "DALI's wds2idx writes it)"
        )
    if len(lines) - 1 != count:
        raise ValueError(
            f"{where} announces {count} samples but holds {len(lines) - 1} lines (cut short?)"
        )
    return lines[1:]


def parse_idx(tar_url: str, where: str, data: bytes) -> TarIndex:
    """The index of ``tar_url`` from the ``.idx`` text ``data`` (read from ``where``);
    ``ValueError`` naming ``where`` and the line when it is not a whole, valid ``v1.2`` index."""
    lines = _lines_of(where, data)
    builder = IndexBuilder(tar_url)
    after = 0  # where the next member's header may start: after the last member's data
    last = ""
    for number, line in enumerate(lines, start=2):
        fields = line.split()
        if not fields or len(fields) % 4:
            raise ValueError(
                f"{where} line {number}: expected <ext> <offset> <size> <name> for each member "
                f"of the sample, got {line[:80]!r}"
            )
        sample = builder.samples  # the one this line must start
        for start in range(0, len(fields), 4):
            ext, offset_text, size_text, name = fields[start : start + 4]
            if not (offset_text.isdigit() and size_text.isdigit()):
                raise ValueError(f"{where} line {number}: offset and size must be integers")
            offset, size = int(offset_text), int(size_text)
            if offset % 512:
                raise ValueError(f"{where} line {number}: offset {offset} is not a multiple of 512")
            if offset < after + _BLOCK:
                raise ValueError(
                    f"{where} line {number}: member {name!r} at byte {offset} "
                    + (
                        f"overlaps {last!r} or comes before it (its data ends at byte {after})"
                        if last
                        else "leaves no room for its header"
                    )
                    + "; a tar holds its members in order, each after the data of the one before "
                    "and its own 512-byte header"
                )
            after, last = offset + -(-size // _BLOCK) * _BLOCK, name
            split = split_name(name)
            if split is not None and split[1] != ext:
                raise ValueError(
                    f"{where} line {number}: member {name!r} listed with extension {ext!r}"
                )
            builder.add(name, offset, size, where, f"(line {number})")
            if builder.samples != sample + 1:
                raise ValueError(
                    f"{where} line {number}: member {name!r} belongs to the sample of another "
                    "line; each line holds one sample's members"
                )
    return builder.build()


def fits(index: TarIndex, tar_size: int) -> bool:
    """Whether a tar of ``tar_size`` bytes can be the one ``index`` was made from: it ends
    after the last member's data, by no more than a tar's tail."""
    end = index.data_end
    return end + 1024 <= tar_size <= end + _TAIL


def last_member(index: TarIndex) -> tuple[str, int, int]:
    """(name, data offset, size) of the member whose data lies last in the tar."""
    row = int(np.argmax(index.member_offset))
    name = f"{index.key(int(index.member_sample[row]))}.{index.exts[int(index.member_ext[row])]}"
    return name, int(index.member_offset[row]), int(index.member_size[row])


def header_mismatch(index: TarIndex, header: bytes) -> str | None:
    """Why ``header`` (the 512 bytes before the last member's data) is not that member's
    header; None when it is."""
    name, _offset, size = last_member(index)
    why = member_mismatch(header, name, size)
    return None if why is None else f"its last member {name!r} ({size} bytes): {why}"


_REGULAR = (b"0", b"\0", b"7")  # (a regular file, an old one, a contiguous one)


def member_mismatch(header: bytes, name: str, size: int) -> str | None:
    """Why ``header`` (the 512 bytes before a member's data) is not the header of a regular
    file ``name`` of ``size`` bytes; None when it is. A plain header is read straight (a few
    microseconds); others (a name in the ustar prefix, a long one) by ``tarfile``."""
    encoded = name.encode("utf-8", "surrogateescape")
    if (
        len(header) == _BLOCK
        and len(encoded) < 100
        and header[: len(encoded) + 1] == encoded + b"\0"
        and header[156:157] in _REGULAR
        and not header[345:346].strip(b"\0")  # (no ustar prefix)
    ):
        size_field = header[124:136].strip(b"\0 ")
        checksum = header[148:156].strip(b"\0 ")
        try:
            plain = int(size_field or b"0", 8) == size and int(checksum, 8) == (
                sum(header) - sum(header[148:156]) + 8 * 32
            )
        except ValueError:
            plain = False
        if plain:
            return None
    try:
        info = tarfile.TarInfo.frombuf(header, "utf-8", "surrogateescape")
    except tarfile.HeaderError as error:
        return f"no tar header before its data ({error})"
    # a long name is cut in the header itself (its whole form is in an extension header before)
    found = info.name.encode("utf-8", "surrogateescape")
    same_name = found == encoded or (len(found) >= 99 and encoded.startswith(found))
    if not same_name or info.size != size or not info.isreg():
        kind = "" if info.isreg() else ", not a regular file"
        return f"the header before its data is of {info.name!r} ({info.size} bytes{kind})"
    return None
