"""What a dataset is made of, part by part, small enough to ride in a saved state. Runs in both
processes (the worker makes it, the trainer compares two).

A dataset's fingerprint says *whether* a state was saved over the same data; its parts say *what*
differs when it was not: the shards of ``sharded_tars`` (name, size, samples), the class folders
of an ImageFolder (name, files, bytes). They travel as one string -- the rows as JSON,
compressed and base64-encoded (about 6 bytes a shard for names like ``train-000123.tar``) -- in
``Sampling.parts``, and are kept in the state beside the fingerprint.
"""

from __future__ import annotations

import base64
import json
import zlib
from collections.abc import Sequence

#: (name, size in bytes, samples): one part of a dataset
Part = tuple[str, int, int]

#: How many names of a kind a message lists before it says "and N more".
SHOWN = 5


def encode_parts(kind: str, parts: Sequence[Part]) -> str:
    """``kind`` (``"shard"``, ``"class folder"``) and its parts, as ``Sampling.parts`` holds
    them."""
    document = json.dumps([kind, [list(part) for part in parts]], separators=(",", ":"))
    return base64.b64encode(zlib.compress(document.encode(), 9)).decode("ascii")


def decode_parts(text: str) -> tuple[str, list[Part]]:
    """The kind and the parts of :func:`encode_parts`'s string; ``ValueError`` when it is not
    one."""
    try:
        kind, rows = json.loads(zlib.decompress(base64.b64decode(text, validate=True)))
        parts = [(str(name), int(size), int(samples)) for name, size, samples in rows]
    except (ValueError, TypeError, zlib.error) as error:
        raise ValueError(f"not a list of a dataset's parts ({error})") from None
    return str(kind), parts


def _listed(names: Sequence[str]) -> str:
    shown = ", ".join(names[:SHOWN])
    return shown + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")


def describe_difference(saved: str, mine: str) -> str | None:
    """What differs between the parts of a saved state's dataset and this loader's: the parts
    missing, added and changed (``"train-000007.tar is missing; train-000009.tar changed (size
    81920 -> 80384)"``); None when either has no parts, they are of other kinds, or none
    differs."""
    try:
        kind, before = decode_parts(saved)
        now_kind, after = decode_parts(mine)
    except ValueError:
        return None
    if kind != now_kind:
        return None
    old, new = {p[0]: p for p in before}, {p[0]: p for p in after}
    missing = [name for name in old if name not in new]
    added = [name for name in new if name not in old]
    changed = []
    for name, (_name, size, samples) in old.items():
        found = new.get(name)
        if found is None or found[1:] == (size, samples):
            continue
        what = []
        if found[2] != samples:
            what.append(f"samples {samples} -> {found[2]}")
        if found[1] != size:
            what.append(f"size {size} -> {found[1]}")
        changed.append(f"{name} ({', '.join(what)})")
    said = []
    if missing:
        said.append(f"{kind}s missing here: {_listed(missing)}")
    if added:
        said.append(f"{kind}s not in the state: {_listed(added)}")
    if changed:
        said.append(f"{kind}s changed: {_listed(changed)}")
    order, now = [p[0] for p in before], [p[0] for p in after]
    if not said and order != now:  # (the same parts, listed in another order)
        at = next(k for k, (a, b) in enumerate(zip(order, now, strict=True)) if a != b)
        said.append(
            f"the same {kind}s in another order ({kind} {at} was {order[at]}, is {now[at]} "
            "here): give them in the state's order (a directory or a glob lists them by name)"
        )
    return "; ".join(said) or None
