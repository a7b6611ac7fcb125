"""A shard found changed by a read: whether its first samples are still those the summary
planned (a truncation or an append keeps them; a rewrite does not)."""

from __future__ import annotations

import io
import tarfile

from workers.sources.tars._changed import _same_first
from workers.sources.tars._index import TarIndex, scan_bytes


def _tar_bytes(samples: list[tuple[str, bytes]]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for key, payload in samples:
            for ext in ("jpg", "cls"):
                info = tarfile.TarInfo(f"{key}.{ext}")
                data = payload if ext == "jpg" else key.encode()
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _index(data: bytes) -> TarIndex:
    index, _damage = scan_bytes("mem://shard.tar", data)
    return index


def test_a_truncated_shard_keeps_its_first_samples() -> None:
    samples = [(f"s{i:03d}", bytes([i]) * (300 + 10 * i)) for i in range(4)]
    whole = _tar_bytes(samples)
    planned = _index(whole)
    third = int(planned.member_offset[planned.member_sample == 2].min())
    cut = _index(whole[: third + 100])  # inside sample 2's first member
    assert planned.samples == 4
    assert cut.samples == 2
    assert _same_first(cut, planned, 2)
    assert not _same_first(cut, planned, 3)  # (more than the cut shard holds)


def test_an_appended_shard_keeps_its_first_samples() -> None:
    samples = [(f"s{i:03d}", bytes([i]) * 500) for i in range(3)]
    planned = _index(_tar_bytes(samples))
    grown = _index(_tar_bytes([*samples, ("s999", b"x" * 500)]))
    assert grown.samples == 4
    assert _same_first(grown, planned, 3)


def test_a_rewritten_shard_is_told_apart() -> None:
    samples = [(f"s{i:03d}", bytes([i]) * 500) for i in range(3)]
    planned = _index(_tar_bytes(samples))
    other_keys = _index(_tar_bytes([("t000", samples[0][1]), *samples[1:]]))
    other_sizes = _index(_tar_bytes([(samples[0][0], b"y" * 900), *samples[1:]]))
    assert not _same_first(other_keys, planned, 3)
    assert not _same_first(other_sizes, planned, 3)
    assert not _same_first(other_sizes, planned, 1)
