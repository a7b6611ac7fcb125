"""A trainer run as its own process by the fault tests: prints worker pids, then iterates."""

from __future__ import annotations

import sys
import time

from loader import Loader
from tests import pipelines as P


def main() -> None:
    with Loader(P.id_source, P.cast_step, batch_size=4, num_workers=2) as loader:
        print(" ".join(map(str, loader.worker_pids())), flush=True)
        while True:
            for batch in loader:
                del batch
                time.sleep(0.01)
                if sys.argv[1:] == ["ready"]:
                    print("iterating", flush=True)
                    sys.argv = sys.argv[:1]


if __name__ == "__main__":
    main()
