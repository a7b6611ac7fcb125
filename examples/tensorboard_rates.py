"""The loader's rates in TensorBoard: a few scalars every N steps, next to the loss.

    pip install tensorboard
    python examples/tensorboard_rates.py --logdir runs/loader --epochs 2
    tensorboard --logdir runs

``log_loader_rates(writer, loader, step)`` is the hook: it writes ``loader.stats().rates()`` (the
last ``window`` seconds: the fraction of the loop's time spent waiting for data, batches per
second, each worker stage's share of the workers' time, the CPUs they kept busy) with
``writer.add_scalar``. Call it every few dozen steps: ``stats()`` costs about a millisecond, no
message to the workers. At the end the script prints ``loader.diagnose()``.

The data is the built-in sample dataset (512 JPEGs) through the main job's image step; the
"training step" is a stand-in that sleeps ``--train-ms``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from loader import FilesDataset, Loader, ensure_sample_dataset
from loader.sample import image_step


def log_loader_rates(writer: Any, loader: Loader, step: int, window: float = 10.0) -> None:
    """Write the loader's rates over the last ``window`` seconds as scalars at ``step``
    (``writer``: a ``torch.utils.tensorboard.SummaryWriter``, or anything with its
    ``add_scalar(tag, value, global_step)``)."""
    for tag, value in loader.stats(window).rates().items():
        writer.add_scalar(tag, value, step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--logdir", default="runs/loader")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--every", type=int, default=10, help="log every N steps")
    parser.add_argument("--train-ms", type=float, default=20.0)
    args = parser.parse_args()

    from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

    root = ensure_sample_dataset()
    writer = SummaryWriter(args.logdir)
    step = 0
    images = FilesDataset(str(root))  # (encoded bytes, label), each image once per epoch
    with Loader(images, image_step, batch_size=args.batch_size, num_workers=args.workers) as loader:
        for _epoch in range(args.epochs):
            for batch in loader:
                time.sleep(args.train_ms / 1000)  # the training step
                del batch
                step += 1
                if step % args.every == 0:
                    log_loader_rates(writer, loader, step)
        writer.close()
        print(loader.diagnose())


if __name__ == "__main__":  # required: workers are spawned and import this module
    main()
