"""Cutting a batch's replaced rows (``cut_replaced=True``, the default) and its padded rows
(``cut_padding=True``): no row of a delivered batch repeats another, and ``info`` says which
rows were cut."""

from __future__ import annotations

import numpy as np
import torch

from loader.engine._views import BatchInfo, _cut_rows


def info(padded: int = 0, replaced: tuple[int, ...] = ()) -> BatchInfo:
    return BatchInfo(0, 0, 0, 0, 0, padded, replaced, (7,) if replaced else ())


def test_a_replaced_row_is_cut_like_padding_from_every_kind_of_output() -> None:
    rows = np.arange(6)[:, None].repeat(3, axis=1)
    ragged = [np.arange(k) for k in range(6)]
    values, cut = _cut_rows([rows, torch.from_numpy(rows.copy()), ragged], info(1, (2,)), 1, (2,))
    assert values[0][:, 0].tolist() == [0, 1, 3, 4]
    assert values[1][:, 0].tolist() == [0, 1, 3, 4]
    assert [len(a) for a in values[2]] == [0, 1, 3, 4]
    assert (cut.padded, cut.replaced, cut.cut, cut.cut_rows) == (0, (), 2, (2, 5))
    assert cut.skipped == (7,)  # (still named)


def test_padding_alone_is_cut_as_views() -> None:
    rows = np.arange(6)
    values, cut = _cut_rows([rows], info(2), 2, ())
    assert values[0].tolist() == [0, 1, 2, 3] and np.shares_memory(values[0], rows)
    assert (cut.cut, cut.cut_rows) == (2, (4, 5))


def test_replaced_rows_alone_are_cut_and_the_padding_stays_flagged() -> None:
    """The defaults: ``cut_replaced=True``, ``cut_padding=False``."""
    rows = np.arange(6)
    values, cut = _cut_rows([rows], info(2, (1,)), 0, (1,))
    assert values[0].tolist() == [0, 2, 3, 4, 5]
    assert (cut.padded, cut.replaced, cut.cut, cut.cut_rows) == (2, (), 1, (1,))


def test_padding_rows_flagged_replaced_and_cut_with_them_leave_the_padding_count() -> None:
    """The defaults, in an epoch's last batch: a sample skipped, its row and the padding after
    it flagged replaced and cut. ``padded`` counts the padding rows that stay (none): it kept 2,
    so ``batch[:info.valid]`` gave no row and the batch's one sample was lost to the trainer."""
    rows = np.arange(4) * 10
    values, cut = _cut_rows([rows], info(2, (1, 2, 3)), 0, (1, 2, 3))
    assert values[0].tolist() == [0]
    assert (cut.padded, cut.replaced, cut.cut_rows) == (0, (), (1, 2, 3))
    assert values[0][: cut.valid].tolist() == [0]  # (the idiom: every real row)


def test_padding_cut_alone_keeps_the_replaced_rows_flagged_where_they_are() -> None:
    """``cut_padding=True, cut_replaced=False``: trailing rows go, a replaced row stays (its
    number still right: rows before it are kept)."""
    rows = np.arange(6)
    values, cut = _cut_rows([rows], info(2, (1,)), 2, ())
    assert values[0].tolist() == [0, 1, 2, 3] and np.shares_memory(values[0], rows)
    assert (cut.padded, cut.replaced, cut.cut_rows) == (0, (1,), (4, 5))


def test_a_batch_of_repeats_alone_keeps_one_row_flagged() -> None:
    """No sample of the batch could be read: rather than an empty batch (a trainer's step, and
    every other rank's in step with it, needs rows), its first row stays, flagged replaced."""
    rows = np.arange(4) * 10
    values, cut = _cut_rows([rows], info(1, (0, 1, 2)), 1, (0, 1, 2))
    assert values[0].tolist() == [0]
    assert (cut.padded, cut.replaced, cut.cut, cut.cut_rows) == (0, (0,), 3, (1, 2, 3))


def test_texts_decode_lists_and_stacked_rows_of_numpy_and_torch() -> None:
    from loader import jsons, texts

    rows = [np.frombuffer("café ☕".encode(), np.uint8), np.zeros(0, np.uint8)]
    assert texts(rows) == ["café ☕", ""]
    stacked = np.frombuffer(b"abcdef", np.uint8).reshape(2, 3)
    assert texts(stacked) == ["abc", "def"] == texts(torch.from_numpy(stacked.copy()))
    assert jsons([np.frombuffer(b'{"k": 1}', np.uint8)]) == [{"k": 1}]


def test_a_batch_of_padding_alone_keeps_one_row_flagged_as_padding() -> None:
    """``cut_padding=True`` over a batch with no sample (a worker with none of its own left in
    the epoch): the row kept is padding, and says so (``padded`` 1, ``valid`` -1); flagged as a
    replaced row with ``padded`` 0, an evaluation loop counted it as a sample, a repeat."""
    rows = np.arange(4) * 10
    values, cut = _cut_rows([rows], info(4), 4, ())
    assert values[0].tolist() == [0]
    assert (cut.padded, cut.replaced, cut.cut, cut.cut_rows) == (1, (), 3, (1, 2, 3))
    assert values[0][: cut.valid].tolist() == []  # (the idiom: every real row, none here)
