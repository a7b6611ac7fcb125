"""Hugging Face ``transformers.Trainer`` over loaders: exact resume and evaluation without the
padded rows. Runs in the trainer; imports ``transformers`` (only this module does).

One line in a training script::

    from loader.hf import LoaderTrainer

    trainer = LoaderTrainer(model=model, args=args, train_loader=train, eval_loader=val)
    trainer.train()                              # or train(resume_from_checkpoint=True)

(``LoaderTrainerMixin`` goes in front of another ``Trainer`` subclass the same way:
``class MyTrainer(LoaderTrainerMixin, SFTTrainer)``.) What it changes in ``Trainer``:

* **The loaders are the dataloaders**: ``get_train_dataloader`` / ``get_eval_dataloader``
  return them as they are (no ``accelerator.prepare``: each rank's loader already reads its own
  shards). ``num_examples`` and the evaluation's sample count are the dataset's real samples.
* **The loader's state is part of every checkpoint**: written into ``checkpoint-N/`` as
  :data:`STATE_NAME` before Trainer writes anything there (Trainer's ``trainer_state.json``,
  which a resume needs, comes last), so no checkpoint that Trainer can resume from lacks it.
  Under ``torch.distributed`` every rank takes part (``state_dict()`` is a collective) and the
  process that saves writes it.
* **Resume without skipping**: ``train(resume_from_checkpoint=...)`` loads the checkpoint's
  loader state first, and Trainer's fast-forward (``get_resumed_dataloader``, accelerate's
  ``skip_first_batches``, which would rebuild a torch ``DataLoader``) returns the loader as it
  is: it already starts at the first batch not trained on. Trainer's step counting, gradient
  accumulation and learning-rate schedule are its own, unchanged. transformers 5.20-5.24 have
  no ``get_resumed_dataloader`` (their ``Trainer`` calls ``transformers.trainer``'s
  ``skip_first_batches`` itself): there, for the time of ``train()``, that name calls the
  trainer's ``get_resumed_dataloader`` instead (our loader as it is; any other dataloader goes
  to accelerate's ``skip_first_batches`` as before), so every version the extras allow resumes
  the same way.
* **Another number of ranks** than the checkpoint's is refused with a ``ValueError`` that says
  what to do: Trainer counts its steps per rank, so on another world size it would start
  another epoch than the one the loader's state continues.
* **Evaluation counts each sample once**: give the evaluation loader ``cut_padding=True`` (its
  epoch's last batch on each rank comes cut to its real rows); predictions and metrics are then
  over exactly the dataset's samples, on several ranks too: where the ranks' last batches hold
  other numbers of rows (a dataset they split unevenly), Trainer's gather pads them to equal
  shapes and cuts the padding off again.
* ``batch.info`` survives Trainer's device transfer (it rebuilds the batch as
  ``type(batch)({...})``): ``compute_loss(model, inputs, ...)`` gets it as ``inputs.info``, in
  training and in evaluation. ``model(**inputs)`` passes the batch's keys only, so the model
  itself never sees it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import logging
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from ._loader import Loader
from .engine import carry_info

#: The file of the loader's state in a Trainer checkpoint directory.
STATE_NAME = "loader_state.json"

logger = logging.getLogger(__name__)


class _Samples:
    """What Trainer is given as a dataset: the loader's real samples per epoch, for its counts
    (``len``). Not indexable: the loader, not Trainer, reads the data."""

    def __init__(self, loader: Loader) -> None:
        self.loader = loader

    def __len__(self) -> int:
        return self.loader.dataset_size

    def __getitem__(self, index: int) -> Any:
        raise TypeError(
            "the loader reads the data: Trainer gets batches from LoaderTrainer's loaders, "
            "not items from a dataset"
        )


class _UnevenRows:
    """Trainer's ``gather_function`` for batches that may hold other numbers of rows on other
    ranks (``cut_padding=True``, a dataset the ranks split unevenly): accelerate gathers equal
    shapes only, so each rank's rows are padded to the most any rank has, gathered, and the
    padding cut off again (one small ``all_gather`` of the row counts per call; nothing more when
    they are equal)."""

    def __init__(self, inner: Callable[..., Any]) -> None:
        self.inner = inner

    def __call__(self, data: Any, use_gather_object: bool = False) -> Any:
        import torch
        import torch.distributed as dist
        from accelerate.utils import recursively_apply

        first = _first_tensor(data)
        if first is None or first.dim() == 0 or not dist.is_initialized():
            return self.inner(data)
        world = dist.get_world_size()
        rows = torch.tensor([first.shape[0]], dtype=torch.int64, device=first.device)
        counts = [torch.zeros_like(rows) for _ in range(world)]
        dist.all_gather(counts, rows)
        sizes = [int(count.item()) for count in counts]
        most = max(sizes)
        if min(sizes) == most:
            return self.inner(data)

        def pad(tensor: Any) -> Any:
            extra = most - tensor.shape[0]
            if extra == 0:
                return tensor
            return torch.cat([tensor, tensor.new_zeros((extra, *tensor.shape[1:]))])

        def cut(tensor: Any) -> Any:
            return torch.cat([tensor[r * most : r * most + sizes[r]] for r in range(world)])

        gathered = self.inner(recursively_apply(pad, data))
        return recursively_apply(cut, gathered)


def _first_tensor(data: Any) -> Any:
    if hasattr(data, "shape") and hasattr(data, "dim"):
        return data
    if isinstance(data, (list, tuple)):
        data = list(data)
    elif isinstance(data, dict):
        data = list(data.values())
    else:
        return None
    for item in data:
        found = _first_tensor(item)
        if found is not None:
            return found
    return None


class LoaderTrainerMixin:
    """``Trainer`` behaviour for loaders (module docstring). Goes before ``Trainer`` (or a
    subclass of it) in the bases; ``train_loader`` / ``eval_loader`` take the place of
    ``train_dataset`` / ``eval_dataset``."""

    def __init__(
        self,
        *args: Any,
        train_loader: Loader | None = None,
        eval_loader: Loader | None = None,
        **kwargs: Any,
    ) -> None:
        self.train_loader = train_loader
        self.eval_loader = eval_loader
        if train_loader is not None:
            kwargs.setdefault("train_dataset", _Samples(train_loader))
        if eval_loader is not None:
            kwargs.setdefault("eval_dataset", _Samples(eval_loader))
        super().__init__(*args, **kwargs)

    @property
    def gather_function(self) -> Any:
        return self._loader_gather

    @gather_function.setter
    def gather_function(self, value: Any) -> None:
        if isinstance(value, functools.partial) and isinstance(value.func, _UnevenRows):
            value = functools.partial(value.func.inner, *value.args, **value.keywords)
        self._loader_gather = value if isinstance(value, _UnevenRows) else _UnevenRows(value)

    # ------------------------------------------------------------------ the loaders themselves
    def get_train_dataloader(self) -> Any:
        if self.train_loader is None:
            return super().get_train_dataloader()  # type: ignore[misc]
        arguments = getattr(self, "args", None)  # (Trainer's TrainingArguments)
        accumulation = int(getattr(arguments, "gradient_accumulation_steps", 1) or 1)
        check_slots(self.train_loader, accumulation)
        return self.train_loader

    def get_test_dataloader(self, test_dataset: Any) -> Any:
        if isinstance(test_dataset, _Samples):  # predict(trainer.eval_dataset)
            return test_dataset.loader
        if isinstance(test_dataset, Loader):  # predict(loader)
            return test_dataset
        return super().get_test_dataloader(test_dataset)  # type: ignore[misc]

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        if isinstance(eval_dataset, _Samples):  # (Trainer.evaluate passes self.eval_dataset)
            return eval_dataset.loader
        if isinstance(eval_dataset, Loader):  # evaluate(eval_dataset=loader)
            return eval_dataset
        if eval_dataset is None and self.eval_loader is not None:
            return self.eval_loader
        return super().get_eval_dataloader(eval_dataset)  # type: ignore[misc]

    def prediction_step(
        self, model: Any, inputs: Any, prediction_loss_only: bool, ignore_keys: Any = None
    ) -> Any:
        """Trainer's, except that a batch of padding alone (``cut_padding=True`` over a step at
        which this rank's worker has no sample left: one row, flagged ``padded``) predicts no
        row: the predictions and labels come empty (the other ranks' gathers go on in step)."""
        found = super().prediction_step(  # type: ignore[misc]
            model, inputs, prediction_loss_only, ignore_keys=ignore_keys
        )
        info, first = getattr(inputs, "info", None), _first_tensor(inputs)
        padded = getattr(info, "padded", 0)
        if not padded or first is None or first.dim() == 0 or first.shape[0] > padded:
            return found
        from accelerate.utils import recursively_apply

        loss, logits, labels = found
        empty = functools.partial(recursively_apply, lambda t: t[:0] if t.dim() else t)
        return (
            loss,
            None if logits is None else empty(logits),
            None if labels is None else empty(labels),
        )

    def get_resumed_dataloader(self, dataloader: Any, num_batches: int) -> Any:
        """The loader as it is: its loaded state starts it at the first batch not trained on
        (Trainer's own count of those, ``num_batches``, is what it continues from). Another
        dataloader goes to ``Trainer``'s own hook, or, on a ``Trainer`` without one
        (transformers 5.20-5.24), to accelerate's ``skip_first_batches`` as there."""
        if isinstance(dataloader, Loader):
            return dataloader
        parent = getattr(super(), "get_resumed_dataloader", None)
        if parent is not None:
            return parent(dataloader, num_batches)
        return _original_skip_first_batches()(dataloader, num_batches)

    def num_examples(self, dataloader: Any) -> int:
        if isinstance(dataloader, Loader):
            return dataloader.dataset_size
        return int(super().num_examples(dataloader))  # type: ignore[misc]

    def _prepare_input(self, data: Any) -> Any:
        return carry_info(super()._prepare_input(data), data)  # type: ignore[misc]

    # ------------------------------------------------------------------ the state in checkpoints
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        if self.train_loader is not None:
            state = self.train_loader.state_dict()  # every rank: a collective under DDP
            if self.args.should_save:  # type: ignore[attr-defined]
                folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"  # type: ignore[attr-defined]
                output_dir = os.path.join(self._get_output_dir(trial=trial), folder)  # type: ignore[attr-defined]
                write_state(output_dir, state)
        super()._save_checkpoint(model, trial)  # type: ignore[misc]

    def train(
        self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any
    ) -> Any:
        checkpoint = resume_from_checkpoint
        if checkpoint is True:
            output_dir = self.args.output_dir  # type: ignore[attr-defined]
            checkpoint = get_last_checkpoint(output_dir)  # type: ignore[no-untyped-call]
            if checkpoint is None:
                raise ValueError(
                    f"resume_from_checkpoint=True, but {output_dir} holds no checkpoint: "
                    "train without it to start afresh"
                )
        if isinstance(checkpoint, str) and self.train_loader is not None:
            state = read_state(checkpoint)
            check_world_size(state, self.args.world_size, checkpoint)  # type: ignore[attr-defined]
            self.train_loader.load_state_dict(state)
        with _resume_hook(self):
            return super().train(checkpoint, *args, **kwargs)  # type: ignore[misc]


def check_slots(loader: Loader, accumulation: int) -> None:
    """``ValueError`` before training when ``gradient_accumulation_steps`` makes Trainer hold
    more of a worker's batches than it has shared-memory slots: Trainer fetches a step's
    ``accumulation`` batches before it lets the last step's go, so up to ``2 * accumulation -
    2`` batches are held at once, and a worker whose slots are all held cannot make the next
    one (a ``SlotsExhaustedError`` after the first optimizer step). Fine with ``copy=True``."""
    config = loader.config
    if accumulation <= 1 or config.copy:
        return
    workers = max(1, config.num_workers)
    held = -(-(2 * accumulation - 2) // workers)
    if held + 1 <= config.num_slots:
        return
    raise ValueError(
        f"gradient_accumulation_steps={accumulation}: Trainer holds up to "
        f"{2 * accumulation - 2} batches at once (it fetches a step's {accumulation} batches "
        f"before it lets the last step's go), {held} of each of the train loader's {workers} "
        f"workers, which have {config.num_slots} shared-memory slots each (prefetch + 2). "
        f"Build the train loader with prefetch={held - 1} (or more), or copy=True"
    )


class LoaderTrainer(LoaderTrainerMixin, Trainer):
    """``transformers.Trainer`` over loaders (module docstring)."""


def write_state(checkpoint: str, state: dict[str, Any]) -> None:
    """Write ``state`` into ``checkpoint`` (created if need be), atomically (a temporary file
    renamed: a kill leaves the old file or the new one, never half of one)."""
    os.makedirs(checkpoint, exist_ok=True)
    target = os.path.join(checkpoint, STATE_NAME)
    temporary = f"{target}.{os.getpid()}.tmp"
    with open(temporary, "w", encoding="utf-8") as f:
        json.dump(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, target)


def read_state(checkpoint: str) -> dict[str, Any]:
    """The loader's state in ``checkpoint``; a ``ValueError`` that says why when it has none."""
    path = os.path.join(checkpoint, STATE_NAME)
    if not os.path.isfile(path):
        raise ValueError(
            f"{checkpoint} has no {STATE_NAME}: it was not saved by a LoaderTrainer (or "
            "LoaderTrainerMixin), so where the loader stood is not known. Resume from a "
            "checkpoint that LoaderTrainer saved, or start the epoch afresh with "
            "train(resume_from_checkpoint=None)"
        )
    with open(path, encoding="utf-8") as f:
        state: dict[str, Any] = json.load(f)
    return state


def check_world_size(state: dict[str, Any], world_size: int, checkpoint: str) -> None:
    """Refuse a checkpoint of another world size: Trainer's step arithmetic is per rank."""
    layout = state.get("layout")
    saved = layout.get("world_size") if isinstance(layout, dict) else None
    if isinstance(saved, int) and saved != world_size:
        raise ValueError(
            f"{checkpoint} was saved on {saved} rank(s), this job has {world_size}: Trainer "
            "counts its steps per rank, so it would resume another epoch than the one the "
            f"loader's state continues. Resume on {saved} rank(s) (Loader.load_state_dict "
            "itself takes any layout, for a training loop that counts its own steps)"
        )


# ---------------------------------------------------------------------- transformers 5.20-5.24
# Their Trainer fast-forwards a resumed epoch with ``skip_first_batches(dataloader, n)``, a name
# that ``transformers.trainer`` imported from accelerate; 5.25 calls the
# ``get_resumed_dataloader`` hook instead. While a LoaderTrainerMixin trains on a Trainer without
# the hook, that module's name is a _SkipFirstBatches: it calls the hook of the trainer that is
# training in this thread (a context variable: threads and nested trainers each see their own),
# and is accelerate's function for anyone else. It is put in place by the first train() running
# and taken out by the last one to end (a count under a lock).

_training: contextvars.ContextVar[LoaderTrainerMixin | None] = contextvars.ContextVar(
    "loader_hf_training", default=None
)
_hook_lock = threading.Lock()
_hook_users = 0


def _has_resume_hook() -> bool:
    """Whether the installed ``transformers.Trainer`` fast-forwards a resumed epoch through
    ``get_resumed_dataloader`` (transformers 5.25 and later)."""
    return callable(getattr(Trainer, "get_resumed_dataloader", None))


class _SkipFirstBatches:
    """``transformers.trainer.skip_first_batches`` while a LoaderTrainerMixin trains on a
    Trainer without ``get_resumed_dataloader``."""

    def __init__(self, original: Callable[..., Any]) -> None:
        self.original = original

    def __call__(self, dataloader: Any, num_batches: int = 0) -> Any:
        trainer = _training.get()
        if trainer is not None:
            return trainer.get_resumed_dataloader(dataloader, num_batches)
        if isinstance(dataloader, Loader):  # (a LoaderTrainer's loader is always in its train())
            return dataloader
        return self.original(dataloader, num_batches)


def _trainer_module() -> Any:
    return sys.modules[Trainer.__module__]


def _original_skip_first_batches() -> Callable[..., Any]:
    current = getattr(_trainer_module(), "skip_first_batches", None)
    if isinstance(current, _SkipFirstBatches):
        return current.original
    if current is not None:
        return current  # type: ignore[no-any-return]
    from accelerate import skip_first_batches

    return skip_first_batches  # type: ignore[no-any-return]


@contextlib.contextmanager
def _resume_hook(trainer: LoaderTrainerMixin) -> Iterator[None]:
    """For the time of ``trainer.train()``: on a Trainer without ``get_resumed_dataloader``,
    its fast-forward calls ``trainer.get_resumed_dataloader`` (nothing changes on one with)."""
    global _hook_users
    module = _trainer_module()
    if _has_resume_hook():
        yield
        return
    with _hook_lock:
        original = getattr(module, "skip_first_batches", None)
        if original is None:
            warnings.warn(
                f"{module.__name__} has neither Trainer.get_resumed_dataloader nor "
                "skip_first_batches: this transformers is not one that LoaderTrainer supports "
                "(see the extra 'hf'), and a resume in the middle of an epoch may fail",
                RuntimeWarning,
                stacklevel=4,
            )
        else:
            if not isinstance(original, _SkipFirstBatches):
                logger.debug(
                    "Trainer has no get_resumed_dataloader: %s.skip_first_batches calls it "
                    "during train()",
                    module.__name__,
                )
                module.skip_first_batches = _SkipFirstBatches(original)
            _hook_users += 1
    if original is None:
        yield
        return
    token = _training.set(trainer)
    try:
        yield
    finally:
        _training.reset(token)
        with _hook_lock:
            _hook_users -= 1
            current = getattr(module, "skip_first_batches", None)
            if _hook_users == 0 and isinstance(current, _SkipFirstBatches):
                module.skip_first_batches = current.original
