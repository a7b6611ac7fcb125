"""A tar shard's index: member names, scans of bad, damaged and whole shards."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests import tar_pipelines as T
from workers.sources.tars._index import split_name
from workers.sources.tars._reader import parse_ext
from workers.sources.tars._shards import open_shards


def test_member_names_split_at_the_first_dot_of_the_file_name() -> None:
    assert split_name("n0144/img.7.jpg") == ("n0144/img", "7.jpg")
    assert split_name("a.b/c.seg.png") == ("a.b/c", "seg.png")
    assert split_name("README") is None
    assert split_name("dir/.hidden") is None
    assert parse_ext(("jpg;png", ".cls")) == [["jpg", "png"], ["cls"]]
    with pytest.raises(ValueError, match="at least one"):
        parse_ext(())


def _tar(path: Path, names: list[str]) -> None:
    with tarfile.open(path, "w") as tar:
        for name in names:
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"1"))


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (["a.jpg", "b.jpg", "a.cls"], "key 'a' appears again"),
        (["a.jpg", "a.jpg"], "two members with extension 'jpg'"),
        (["a.jpg", "noext"], "has no extension"),
    ],
)
def test_a_shard_with_bad_members_is_refused_naming_them(
    tmp_path: Path, names: list[str], message: str
) -> None:
    _tar(tmp_path / "bad.tar", names)
    with pytest.raises(ValueError, match=f"bad.tar: .*{message}"):
        open_shards(str(tmp_path / "bad.tar"), None, 0.0)


@pytest.mark.parametrize("seekable", [True, False])
def test_a_damaged_shard_keeps_its_whole_samples_before_the_damage(
    tmp_path: Path, seekable: bool
) -> None:
    """Cut anywhere, a shard gives the samples whose members all lie before the cut (never a
    sample missing a member), and the error a strict scan raises; garbage gives none."""
    from workers.sources.tars._index import scan, scan_whole_samples

    T.write_id_tars(tmp_path, 7, 7)
    data = (tmp_path / "train-000.tar").read_bytes()
    full = scan(str(tmp_path / "train-000.tar"), io.BytesIO(data), seekable=True)
    ends = [  # where each sample's last member ends
        int((full.member_offset + full.member_size)[full.member_sample == k].max())
        for k in range(full.samples)
    ]
    for cut in range(0, ends[-1] + 1024, 97):  # (after the end-of-archive blocks: whole)
        stream = io.BytesIO(data[:cut])
        if not seekable:  # (a remote shard is read as a stream)
            stream.seekable = lambda: False  # type: ignore[method-assign]
        index, damage = scan_whole_samples("t.tar", stream, seekable=seekable, size=cut)
        assert damage is not None and "t.tar" in str(damage)
        assert index.samples <= sum(end <= cut for end in ends)
        assert index.samples >= sum(end <= cut for end in ends) - 1  # (the cut one's neighbour)
        for k in range(index.samples):  # each kept sample is whole
            assert (index.member_sample == k).sum() == (full.member_sample == k).sum()
    index, damage = scan_whole_samples("t.tar", io.BytesIO(b"not a tar" * 200), seekable=seekable)
    assert index.samples == 0 and "is not a tar file" in str(damage)
    assert "gzip" not in str(damage)
    import gzip

    zipped = io.BytesIO(gzip.compress(data))
    index, damage = scan_whole_samples("t.tar.gz", zipped, seekable=seekable)
    assert index.samples == 0 and "it is gzip-compressed" in str(damage)
    if seekable:  # (named .tar: told by its first bytes)
        zipped = io.BytesIO(gzip.compress(data))
        index, damage = scan_whole_samples("t.tar", zipped, seekable=True)
        assert "it is gzip-compressed" in str(damage)


def _tar_bytes(form: int, names: list[str], seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=form) as tar:
        for name in names:
            payload = rng.bytes(int(rng.integers(0, 3000)))
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
        folder = tarfile.TarInfo("folder/")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)
    return buffer.getvalue()


@pytest.mark.parametrize("form", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_a_shard_read_whole_is_indexed_from_its_headers_as_tarfile_reads_it(form: int) -> None:
    """The fast reading of a whole shard's headers gives what ``tarfile`` gives, or stands
    aside (long names, pax headers) and lets it read; a shard cut short or with a damaged
    header is never taken as whole by it."""
    from workers.sources.tars._index import _members, _plain_members, scan

    def by_tarfile(data: bytes) -> tuple[Any, Any]:
        members, _offset, damage = _members("t.tar", io.BytesIO(data), seekable=True, size=None)
        return members, damage

    rng = np.random.default_rng(form)
    plain = [f"s{i:04d}.jpg" for i in range(30)]
    for names in (
        plain,
        [f"{'x' * 120}/s{i}.cls" for i in range(4)],
        [f"é{i}.id" for i in range(4)],
    ):
        data = _tar_bytes(form, names, seed=len(names))
        fast = _plain_members(data)
        members, damage = by_tarfile(data)
        assert damage is None
        if names is plain or form == tarfile.USTAR_FORMAT:
            assert fast == members  # (ustar splits a long name into its prefix field)
        assert fast is None or fast == members
        assert scan("t.tar", io.BytesIO(data), seekable=True).samples == len(names)
        variants = [data[:cut] for cut in (len(data) - 1, len(data) - 1024, len(data) // 2, 700)]
        for at in rng.choice(len(data), 40, replace=False).tolist():
            damaged = bytearray(data)
            damaged[at] ^= 0x41
            variants.append(bytes(damaged))
        for variant in variants:
            fast = _plain_members(variant)
            members, damage = by_tarfile(variant)
            assert fast is None or (damage is None and fast == members)


def test_a_key_that_comes_again_later_names_both_places_of_what_is_left_out() -> None:
    """Samples 0-7, then a member of sample 3 again: under skip the samples before the damage
    are read but sample 3 (its key comes again in the part left out); the account said "the
    rest of it, from sample 's00003' at byte 7680", which read as if samples 4-7 were left out
    too."""
    from workers.sources.tars._index import scan_whole_samples

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name in [*(f"s{key:05d}.id" for key in range(8)), "s00003.txt"]:
            data = name.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    index, damage = scan_whole_samples("t.tar", io.BytesIO(buffer.getvalue()), seekable=True)
    assert damage is not None and "'s00003' appears again" in str(damage)
    keys = [index.key(k) for k in range(index.samples)]
    assert keys == ["s00000", "s00001", "s00002", "s00004", "s00005", "s00006", "s00007"]
    assert index.left_from.startswith("sample 's00003' at byte ")
    assert "(and, before it, sample(s) 's00003' at byte 3072, whose key comes again" in (
        index.left_from
    )
