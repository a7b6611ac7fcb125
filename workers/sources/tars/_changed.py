"""What a shard found changed by a read gets (no listing was made: a summary vouched for it):
its bytes now decide, as a listing at the start would have (docs/datasets.md, errors).
Runs in the worker.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..storage import Identity, IdentityChanged
from ._index import TarIndex, scan_bytes
from ._indexer import WHOLE_SCAN_BYTES, Indexer, index_command
from ._shards import TarShards


def changed_answer(
    shards: TarShards,
    shard: int,
    found: Identity,
    vouched: str | None,
    planned_index: Callable[[], TarIndex],
    skip: bool,
    indexer: Indexer,
) -> tuple[Identity, int, int | None]:
    """A read found ``shard`` other than the summary ``vouched`` (no listing was made) says:
    its bytes now (one GET) decide, as a listing at the start would have (docs/datasets.md,
    errors). Shorter, its whole samples the first ones planned: damaged data, a
    ``ValueError`` naming the shard, where it ends and the stale summary; under
    ``on_error="skip"`` its whole samples are read and the rest left out (each skipped
    where the epoch planned it), with a warning. Longer, the planned samples where they
    were: what the summary covers is read, with a warning. Anything else (rewritten) is a
    ``StorageFailure`` naming the command that indexes it again."""
    url, planned = shards.urls[shard], shards.identities[shard][0]
    if vouched is None or found[0] > WHOLE_SCAN_BYTES:
        raise shards.changed(shard, found)
    table = planned_index()
    try:
        data = shards.storage.read(url, 0, found[0], expect=found)
    except IdentityChanged as error:  # (changed again meanwhile)
        raise shards.changed(shard, error.found) from error
    now, _damage = scan_bytes(url, data.tobytes())
    whole = min(now.samples, table.samples)
    grew = found[0] > planned and whole == table.samples
    if not _same_first(now, table, whole) or (found[0] >= planned and not grew):
        raise shards.changed(shard, found)  # (rewritten: other bytes, other samples)
    mend = "rewrite the shard (or take it out of the job's shards), then run "
    mend += index_command(url)
    if found[0] < planned:
        message = (
            f"{url} is not a whole tar file: it ends at byte {found[0]}, where the summary "
            f"{vouched} that this job planned its epochs with says {planned} (truncated "
            f"since it was indexed: the summary is stale for it); {mend}"
        )
        if not skip:
            raise ValueError(message)
        kept = table.member_sample < whole
        read_to = int((table.member_offset[kept] + table.member_size[kept]).max(initial=0))
        indexer.warn(
            f"on_error='skip': {message}. Its first {whole} samples are read (up to byte "
            f"{read_to} of {found[0]}); the other {table.samples - whole} planned samples "
            "of it are left out of every epoch (each skipped where it was planned)"
        )
        return found, found[0], whole
    indexer.warn(
        f"{url} grew since it was indexed ({planned} -> {found[0]} bytes): the summary "
        f"{vouched} that this job planned its epochs with is stale for it. The "
        f"{table.samples} samples it covers are read, none added since; run "
        f"{index_command(url)} (then restart the job) to read them all"
    )
    return found, found[0], None


def _same_first(now: TarIndex, planned: TarIndex, samples: int) -> bool:
    """Whether the first ``samples`` samples of ``now`` are those of ``planned``: the same keys,
    members and bytes' places."""
    if samples > now.samples or samples > planned.samples:
        return False
    ends = int(now.key_offsets[samples]), int(planned.key_offsets[samples])
    if ends[0] != ends[1] or bytes(now.keys[: ends[0]]) != bytes(planned.keys[: ends[1]]):
        return False
    mine, theirs = now.member_sample < samples, planned.member_sample < samples
    return (
        np.array_equal(now.member_offset[mine], planned.member_offset[theirs])
        and np.array_equal(now.member_size[mine], planned.member_size[theirs])
        and [now.exts[e] for e in now.member_ext[mine].tolist()]
        == [planned.exts[e] for e in planned.member_ext[theirs].tolist()]
    )
