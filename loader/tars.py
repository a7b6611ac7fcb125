"""``python -m loader.tars``: turn an ImageFolder into WebDataset tar shards.

``python -m loader.tars --from DIR --to OUT --samples-per-shard N`` writes ``OUT/train-000000.tar``
and on, each sample ``<key>.jpg`` (the file's bytes; another image extension is kept) and
``<key>.cls`` (its label), in a seeded random order; read them with ``sharded_tars``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from workers import write_tars


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loader.tars",
        description="Write an ImageFolder (root/<class>/<image>) as WebDataset tar shards.",
    )
    parser.add_argument("--from", dest="source", required=True, help="the ImageFolder's root")
    parser.add_argument("--to", dest="target", required=True, help="where to write the shards")
    parser.add_argument(
        "--samples-per-shard",
        type=int,
        required=True,
        help="samples in each shard (the last may hold fewer)",
    )
    parser.add_argument("--prefix", default="train", help="shard names: PREFIX-000000.tar ...")
    parser.add_argument("--seed", type=int, default=0, help="seed of the samples' order")
    parser.add_argument(
        "--no-shuffle",
        action="store_true",
        help="keep the folder's order (classes one after another) instead of a seeded random one",
    )
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        written = write_tars(
            args.source,
            args.target,
            samples_per_shard=args.samples_per_shard,
            shuffle=not args.no_shuffle,
            seed=args.seed,
            prefix=args.prefix,
        )
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    size = sum(path.stat().st_size for path in written)
    last = written[-1].name
    print(
        f"wrote {len(written)} shards ({size / 1e6:.1f} MB) in {time.monotonic() - started:.1f} s: "
        f"{written[0].parent}/{args.prefix}-{{{'0' * 6}..{last[len(args.prefix) + 1 : -4]}}}.tar"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
