"""``python -m bench``: the side-by-side benchmark suite (see bench/run.py)."""

from bench.run import main

main()
