"""Hugging Face ``transformers.Trainer`` fed by dali-capture-loader: a small CNN on JPEGs
(decode, random crop, random flip in DALI), mid-epoch checkpoints that hold the loader's state,
an exact resume, and evaluation over exactly the dataset's samples.

    python examples/hf_trainer.py --out runs/hf                      # train, checkpoints
    python examples/hf_trainer.py --out runs/hf --resume             # from the newest one
    torchrun --nproc-per-node 2 examples/hf_trainer.py --out runs/hf # on 2 ranks (gloo, CPU)

What ties them together is one line, ``LoaderTrainer`` (``loader.hf``) in place of ``Trainer``:
``train_loader=`` and ``eval_loader=`` instead of datasets. The evaluation loader is made with
``cut_padding=True``, so its last batch on each rank comes cut to its real rows and
``evaluate()`` sees every sample once.

``--events FILE`` appends one JSON line per event: ``start`` (the transformers version that
runs), ``batch`` (each training batch as the model sees it: Trainer's ``global_step`` before it,
``batch.info``'s epoch and step, a digest of its bytes), ``eval`` (the sample ids the predictions
cover, the metrics) and ``end`` (a digest of the weights). ``--kill-after-save K`` SIGKILLs the
process once the checkpoint of step K is saved, as a crash.

DALI runs in the workers; the script imports torch and transformers only inside ``main``: every
worker imports this module and needs neither.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import signal
from pathlib import Path
from typing import Any

import numpy as np

from loader import Loader, SamplesDataset, list_images, ndd


def _load(index: int, files: list[str], labels: list[int]) -> tuple[Any, ...]:
    """Sample ``index``: its JPEG bytes, its class and its id."""
    with open(files[index], "rb") as f:
        jpeg = np.frombuffer(f.read(), dtype=np.uint8)
    return jpeg, np.array(labels[index], dtype=np.int64), np.array(index, dtype=np.int64)


def dataset(root: str, shuffle: bool = True) -> SamplesDataset:
    """The images of ``root`` as (JPEG bytes, class, id): each once an epoch, in batches of the
    Loader's ``batch_size``."""
    files, labels = list_images(root)
    load = functools.partial(_load, files=[str(f) for f in files], labels=list(labels))
    return SamplesDataset(len(files), load, num_outputs=3, shuffle=shuffle)


def train_step(jpegs: Any, labels: Any, ids: Any) -> dict[str, Any]:
    """Decode, random crop 32x32 and random flip: the random draws a resume must replay."""
    images = ndd.decoders.image(jpegs, device="cpu")
    images = ndd.random_resized_crop(images, size=[32, 32])
    flip = ndd.random.coin_flip(probability=0.5, batch_size=images.batch_size)
    pixels = ndd.crop_mirror_normalize(images, dtype=ndd.float32, mirror=flip, std=[255.0] * 3)
    return {"pixels": pixels, "labels": labels, "ids": ids}


def eval_step(jpegs: Any, labels: Any, ids: Any) -> dict[str, Any]:
    images = ndd.resize(ndd.decoders.image(jpegs, device="cpu"), size=[32, 32])
    pixels = ndd.crop_mirror_normalize(images, dtype=ndd.float32, std=[255.0] * 3)
    return {"pixels": pixels, "labels": labels, "ids": ids}


def _digest(*arrays: Any) -> str:
    digest = hashlib.sha256()
    for array in arrays:
        digest.update(np.ascontiguousarray(array.detach().cpu().numpy()).tobytes())
    return digest.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=None, help="an ImageFolder (default: sample)")
    parser.add_argument("--out", type=Path, required=True, help="Trainer's output_dir")
    parser.add_argument("--events", type=Path, default=None)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--prefetch", type=int, default=2, help="batches each worker runs ahead")
    parser.add_argument("--save-steps", type=int, default=5)
    parser.add_argument("--resume", action="store_true", help="from the newest checkpoint")
    parser.add_argument("--kill-after-save", type=int, default=None, metavar="K")
    parser.add_argument("--no-eval", action="store_true")
    args = parser.parse_args()

    import torch
    import transformers
    from transformers import TrainerCallback, TrainingArguments

    from loader import ensure_sample_dataset
    from loader.hf import LoaderTrainer

    root = str(args.data or ensure_sample_dataset())
    rank = int(os.environ.get("RANK", "0"))

    def log(record: dict[str, Any]) -> None:
        if args.events is not None:
            with open(args.events, "a") as f:
                f.write(json.dumps({"rank": rank, **record}) + "\n")

    log({"event": "start", "transformers": transformers.__version__, "resume": args.resume})

    class Net(torch.nn.Module):
        def __init__(self, classes: int) -> None:
            super().__init__()
            self.features = torch.nn.Sequential(
                torch.nn.Conv2d(3, 8, 3, stride=2), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1)
            )
            self.head = torch.nn.Linear(8, classes)

        def forward(self, pixels: Any, labels: Any, ids: Any) -> dict[str, Any]:
            logits = self.head(self.features(pixels).flatten(1))
            loss = torch.nn.functional.cross_entropy(logits, labels.reshape(-1))
            return {"loss": loss, "logits": logits, "ids": ids.reshape(-1)}

    class Logged(LoaderTrainer):
        def compute_loss(self, model: Any, inputs: Any, *rest: Any, **kw: Any) -> Any:
            if model.training:
                info = inputs.info
                log(
                    {
                        "event": "batch",
                        "global_step": self.state.global_step,
                        "epoch": info.epoch,
                        "step": info.step,
                        "digest": _digest(inputs["pixels"], inputs["labels"]),
                    }
                )
            return super().compute_loss(model, inputs, *rest, **kw)

    class KillAfterSave(TrainerCallback):
        def on_save(self, targs: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == args.kill_after_save:
                if torch.distributed.is_available() and torch.distributed.is_initialized():
                    # every rank's part of the checkpoint is written (rank 0 writes the
                    # Trainer's state last): a rank killed sooner would have the launcher
                    # end the others mid-save
                    torch.distributed.barrier()
                os.kill(os.getpid(), signal.SIGKILL)

    def compute_metrics(prediction: Any) -> dict[str, float]:
        logits, ids = prediction.predictions
        labels = prediction.label_ids
        log({"event": "eval", "ids": sorted(int(i) for i in np.ravel(ids))})
        return {"accuracy": float((np.argmax(logits, -1) == labels).mean()), "rows": len(ids)}

    torch.manual_seed(0)
    classes = len(set(list_images(root)[1]))
    training = TrainingArguments(
        output_dir=str(args.out),
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        gradient_accumulation_steps=args.accumulate,
        num_train_epochs=args.epochs,
        save_strategy="steps",
        save_steps=args.save_steps,
        eval_strategy="no",
        logging_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_pin_memory=False,
        label_names=["labels"],
        ddp_backend="gloo" if "WORLD_SIZE" in os.environ else None,
        seed=0,
    )
    train, evaluate = dataset(root), dataset(root, shuffle=False)
    common = {
        "batch_size": args.batch_size,
        "num_workers": args.workers,
        "prefetch": args.prefetch,
        "output": "torch",
    }
    with (
        Loader(train, train_step, **common) as train_loader,
        Loader(evaluate, eval_step, cut_padding=True, **common) as eval_loader,
    ):
        trainer = Logged(
            model=Net(classes),
            args=training,
            train_loader=train_loader,
            eval_loader=eval_loader,
            compute_metrics=compute_metrics,
            callbacks=[KillAfterSave()] if args.kill_after_save else [],
        )
        trainer.train(resume_from_checkpoint=True if args.resume else None)
        metrics = {} if args.no_eval else trainer.evaluate()
        weights = [p for _, p in sorted(trainer.model.state_dict().items())]
        log({"event": "end", "weights": _digest(*weights), "metrics": metrics})


if __name__ == "__main__":
    main()
