"""The footers of a plan's files, kept small: each one's bytes without the metadata every file
repeats, compressed, and parsed again when a row group of its file is read. Runs in the worker.

A parsed footer (pyarrow's ``FileMetaData``) of a file ``datasets`` wrote holds its key-value
metadata (the features, pyarrow's Arrow schema: 17 KB of an 18 KB footer, 32 KB with a
1,000-name ``ClassLabel``) decoded, and more besides: a worker that kept every file's parsed
footer held 1.3 GB at 10,000 files, and took 4.5 s to plan. :class:`KeptFooters` keeps each
footer's bytes instead, the first file's long metadata values once
(:func:`~workers.sources.parquet._summary.shared_values`) and the rest zlib-compressed, about
2 KB a file; ``kept[k]`` parses file ``k``'s footer when it is asked for, the last
:data:`PARSED` of them kept parsed (a worker reads its row groups a few files at a time).
"""

from __future__ import annotations

import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..storage import Identity, Storage
from ._footers import node_footers_into, parse_footer
from ._summary import FileEntry, restore, shared_values, strip

__all__ = ["PARSED", "KeptFooters", "node_footers"]

#: Footers kept parsed at once (the most recently asked for).
PARSED = 16


class KeptFooters(Sequence[Any]):
    """The footers of ``urls``, kept small; ``kept[k]`` is file ``k``'s parsed footer. Each of
    ``footers`` is the footer's bytes, or a summary's :class:`FileEntry` (kept as the summary
    keeps it: not decompressed until asked for). Bytes that do not parse are read again with
    ``reread(k)`` where it gives them (a node cache's entry spoilt), else ``ValueError`` names
    the file."""

    def __init__(
        self,
        urls: Sequence[str],
        footers: Sequence[bytes | FileEntry] = (),
        reread: Callable[[int], bytes | None] | None = None,
    ) -> None:
        self._urls = list(urls)
        self._reread = reread
        #: the long metadata values kept once: this plan's own (from the first footer put as
        #: bytes; None until then), then each summary's
        self._shared: list[tuple[bytes, ...] | None] = [None]
        self._kept: list[tuple[bytes, tuple[tuple[int, int], ...], int] | None]
        self._kept = [None] * len(self._urls)
        self._parsed: OrderedDict[int, Any] = OrderedDict()
        self._lock = threading.Lock()  # (the reader's threads ask for footers too)
        for number, footer in enumerate(footers):
            self.put(number, footer)

    def put(self, number: int, footer: bytes | FileEntry) -> None:
        """File ``number``'s footer: its bytes, or a summary's entry."""
        with self._lock:
            self._kept[number] = self._packed(footer)
            self._parsed.pop(number, None)

    def _packed(self, footer: bytes | FileEntry) -> tuple[bytes, tuple[tuple[int, int], ...], int]:
        if isinstance(footer, FileEntry):
            if footer.shared is not None:
                if footer.shared not in self._shared:
                    self._shared.append(footer.shared)
                return footer.kept, footer.cuts, self._shared.index(footer.shared)
            footer = footer.footer
        own = self._shared[0]
        if own is None:
            own = self._shared[0] = tuple(shared_values(footer))
        stripped, cuts = strip(footer, list(own))
        return zlib.compress(stripped, 1), tuple((at, k) for at, k in cuts), 0

    def __len__(self) -> int:
        return len(self._kept)

    def __iter__(self) -> Iterator[Any]:
        return (self[k] for k in range(len(self)))

    def __getitem__(self, number: Any) -> Any:
        if not isinstance(number, int):
            raise TypeError("KeptFooters takes one file's number")
        with self._lock:
            found = self._parsed.get(number)
            if found is not None:
                self._parsed.move_to_end(number)
                return found
        try:
            parsed = parse_footer(self._urls[number], self.data(number))
        except ValueError:
            again = None if self._reread is None else self._reread(number)
            if again is None:
                raise
            parsed = parse_footer(self._urls[number], again)
            self.put(number, again)
        with self._lock:
            self._parsed[number] = parsed
            while len(self._parsed) > PARSED:
                self._parsed.popitem(last=False)
        return parsed

    def data(self, number: int) -> bytes:
        """File ``number``'s footer, its bytes as read."""
        kept = self._kept[number]
        if kept is None:
            raise IndexError(f"no footer was put for file {number} ({self._urls[number]})")
        packed, cuts, shared = kept
        return restore(zlib.decompress(packed), cuts, list(self._shared[shared] or ()))


def node_footers(
    storage: Storage,
    urls: Sequence[str],
    identities: Sequence[Identity],
    read: Callable[[int], bytes],
) -> Any:
    """The footers of ``urls`` (``read(number)``: the footer bytes of file ``number``), parsed
    when asked for (:class:`KeptFooters`): read here for local
    files, through this node's cache for remote ones (see the module docstring). A remote
    one's bytes that do not parse are read again from the store."""
    kept = KeptFooters(urls, reread=None if storage.local else read)
    node_footers_into(storage, urls, identities, read, kept.put)
    return kept
