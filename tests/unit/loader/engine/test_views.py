"""Cutting a batch's padded and replaced rows (``cut_padding=True``): no row of a delivered
batch repeats another, and ``info`` says which rows were cut."""

from __future__ import annotations

import numpy as np
import torch

from loader.engine._views import BatchInfo, _cut_rows


def info(padded: int = 0, replaced: tuple[int, ...] = ()) -> BatchInfo:
    return BatchInfo(0, 0, 0, 0, 0, padded, replaced, (7,) if replaced else ())


def test_a_replaced_row_is_cut_like_padding_from_every_kind_of_output() -> None:
    rows = np.arange(6)[:, None].repeat(3, axis=1)
    ragged = [np.arange(k) for k in range(6)]
    values, cut = _cut_rows([rows, torch.from_numpy(rows.copy()), ragged], info(1, (2,)))
    assert values[0][:, 0].tolist() == [0, 1, 3, 4]
    assert values[1][:, 0].tolist() == [0, 1, 3, 4]
    assert [len(a) for a in values[2]] == [0, 1, 3, 4]
    assert (cut.padded, cut.replaced, cut.cut, cut.cut_rows) == (0, (), 2, (2, 5))
    assert cut.skipped == (7,)  # (still named)


def test_padding_alone_is_cut_as_views() -> None:
    rows = np.arange(6)
    values, cut = _cut_rows([rows], info(2))
    assert values[0].tolist() == [0, 1, 2, 3] and np.shares_memory(values[0], rows)
    assert (cut.cut, cut.cut_rows) == (2, (4, 5))


def test_texts_decode_lists_and_stacked_rows_of_numpy_and_torch() -> None:
    from loader import jsons, texts

    rows = [np.frombuffer("café ☕".encode(), np.uint8), np.zeros(0, np.uint8)]
    assert texts(rows) == ["café ☕", ""]
    stacked = np.frombuffer(b"abcdef", np.uint8).reshape(2, 3)
    assert texts(stacked) == ["abc", "def"] == texts(torch.from_numpy(stacked.copy()))
    assert jsons([np.frombuffer(b'{"k": 1}', np.uint8)]) == [{"k": 1}]
